#!/usr/bin/env python3
"""The Python package's ctypes mirrors have the layout of the C structs they mirror.

A ctypes Structure is a second, hand-written copy of a public struct: a field appended in C
and not in Python makes the library write past the Python object (an output struct) or read
the caller's garbage as an option, and nothing else would notice. So this script:

1. reads every `typedef struct dflash_x { ... } dflash_x;` of include/dflash/*.h and writes
   a C program (struct_layout.c, in a temporary folder) that includes the public headers and
   prints, as JSON, each struct's sizeof and each field's offsetof, size, element count and
   kind (int, uint, float, pointer, char), all from the compiler;
2. compiles it with the build's C compiler and runs it;
3. imports the bindings (the library named by DFLASH_LIBRARY) and compares every
   ctypes.Structure subclass of the package with its C struct, by the MIRRORS table below:
   the same fields in the same order, each at the same offset with the same size and kind,
   and the same sizeof. It fails naming the struct and the field.

A class of the package that derives from ctypes.Structure and has no row, or a public struct
with neither a mirror nor a row in UNMIRRORED, fails too: a new struct gets its row here.

  check_mirrors.py INCLUDE_DIR [--print-c] -- CC [CC ARGS...]
"""
import ctypes
import importlib
import inspect
import json
import pathlib
import pkgutil
import re
import subprocess
import sys
import tempfile

# C struct -> the class ("module:Class" in the libdflash package) that holds all its fields.
MIRRORS = {
    "dflash_chat_options": "chat:_Options",
    "dflash_chat_span": "chat:_Span",
    "dflash_dataset_writer_options": "dataset:_WriterOptions",
    "dflash_dataset_build_stats": "dataset:BuildStats",
    "dflash_dataset_build_options": "dataset:_BuildOptions",
    "dflash_drafter_config": "train:DrafterConfig",
    "dflash_fetch_options": "fetch:_Options",
    "dflash_fetch_stats": "fetch:Stats",
    "dflash_fetch_server_stats": "fetch:ServerStats",
    "dflash_hidden_writer_options": "hidden:WriterOptions",
    "dflash_hidden_rows": "hidden:Rows",
    "dflash_spool_options": "hidden:SpoolOptions",
    "dflash_hidden_info": "hidden:_HiddenInfo",
    "dflash_spool_info": "hidden:_SpoolInfo",
    "dflash_hidden_writer_spool_status": "hidden:_SpoolStatus",
    "dflash_train_stats": "train:TrainStats",
    "dflash_train_run_options": "train:TrainRunOptions",
    "dflash_tensor": "safetensors:_Tensor",
    # hidden.Sample is what streams and spools fill; train.TrainSample derives from it and
    # appends the trainer's anchors, so it is the one that holds every field.
    "dflash_sample": "train:TrainSample",
    "dflash_sample_stream_options": "hidden:StreamOptions",
    "dflash_storage_options": "storage:_Options",
    "dflash_storage_info": "storage:_Info",
    "dflash_chunk_writer_options": "storage:_ChunkOptions",
    "dflash_tokenizer_options": "tokenizer:_Options",
    "dflash_trainer_options": "train:TrainerOptions",
    "dflash_eval": "train:Eval",
    "dflash_eval_walk": "train:EvalWalk",
    "dflash_train_plan_options": "train:TrainPlanOptions",
    "dflash_train_plan": "train:TrainPlan",
    "dflash_propose_options": "train:ProposeOptions",
    "dflash_propose_outputs": "train:ProposeOutputs",
}
# Classes that mirror the leading fields of a struct only (a base class that a full mirror
# extends): checked field by field as far as they go, sizeof not compared.
PREFIXES = {
    "hidden:Sample": "dflash_sample",
}
# Public structs that Python does not mirror, each with the reason.
UNMIRRORED = {}

# C scalar types by the kind the Python side must have (the size comes from the compiler).
KINDS = {
    "int8_t": "int", "int16_t": "int", "int32_t": "int", "int64_t": "int", "int": "int",
    "uint8_t": "uint", "uint16_t": "uint", "uint32_t": "uint", "uint64_t": "uint",
    "size_t": "uint", "unsigned": "uint", "double": "float", "float": "float", "char": "char",
}


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def split_top(text, sep):
    """Split at `sep` outside parentheses and brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += ch in "(["
        depth -= ch in ")]"
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def parse_headers(include_dir):
    """{struct: [(field, kind, is_array)]} in declaration order, and the headers read."""
    headers = sorted((pathlib.Path(include_dir) / "dflash").glob("*.h"))
    texts = {h.name: strip_comments(h.read_text()) for h in headers}
    fn_typedefs = set()
    for text in texts.values():
        fn_typedefs.update(re.findall(r"typedef[^;{}]*?\(\s*\*\s*(\w+)\s*\)\s*\(", text))
    structs = {}
    for name, text in texts.items():
        for m in re.finditer(r"typedef struct (dflash_\w+) \{(.*?)\}\s*\1\s*;", text, flags=re.S):
            structs[m.group(1)] = parse_body(m.group(1), m.group(2), fn_typedefs)
    return headers, structs


def parse_body(struct, body, fn_typedefs):
    fields = []
    if "{" in body or "}" in body:
        raise SystemExit(f"{struct}: a nested struct or union; teach check_mirrors.py to read it")
    for decl in split_top(body, ";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        if re.search(r"[^:]:[^:]", decl):
            raise SystemExit(f"{struct}: a bit-field ({decl!r}); teach check_mirrors.py")
        fp = re.fullmatch(r".*\(\s*\*\s*(\w+)\s*\)\s*\(.*\)", decl)
        if fp:  # a function pointer spelled out in the struct
            fields.append((fp.group(1), "pointer", False))
            continue
        first, *more = split_top(decl, ",")
        m = re.fullmatch(r"((?:const\s+)?(?:struct\s+)?[A-Za-z_]\w*(?:\s+const)?)\s*(.*)",
                         first.strip())
        if not m:
            raise SystemExit(f"{struct}: cannot read {decl!r}")
        base = " ".join(m.group(1).replace("const", " ").split())
        for declarator in [m.group(2)] + more:
            d = re.fullmatch(r"\s*((?:\*\s*(?:const\s*)?)*)(\w+)\s*((?:\[[^\]]+\])*)\s*",
                             declarator)
            if not d:
                raise SystemExit(f"{struct}: cannot read the declarator {declarator!r}")
            stars, field, dims = d.groups()
            if dims.count("[") > 1:
                raise SystemExit(f"{struct}.{field}: a multi-dimensional array; teach me")
            if stars or base in fn_typedefs:
                kind = "pointer"
            elif base in KINDS:
                kind = KINDS[base]
            else:
                raise SystemExit(f"{struct}.{field}: type {base!r} unknown to check_mirrors.py "
                                 "(public structs hold fixed-width types, HACKING.md)")
            fields.append((field, kind, bool(dims)))
    if not fields:
        raise SystemExit(f"{struct}: no fields read")
    return fields


def layout_program(headers, structs):
    """The C program printing each struct's layout as JSON (one struct per line)."""
    out = ["/* Generated by tests/abi/check_mirrors.py from the public headers. */",
           "#include <stddef.h>", "#include <stdio.h>"]
    out += [f"#include <dflash/{h.name}>" for h in headers]
    out += ["", "typedef struct {", "  const char *name, *kind;",
            "  size_t offset, size, count;", "} field_row;", ""]
    for struct, fields in structs.items():
        out.append(f"static const field_row F_{struct}[] = {{")
        for field, kind, is_array in fields:
            member = f"((const {struct} *)0)->{field}"
            count = f"sizeof({member}) / sizeof({member}[0])" if is_array else "1"
            out.append(f'  {{"{field}", "{kind}", offsetof({struct}, {field}), sizeof({member}), '
                       f"{count}}},")
        out.append("};")
    out += ["", "static void print_struct(const char *name, size_t size, const field_row *f,",
            "                         size_t n, int last) {",
            '  printf("  \\"%s\\": {\\"size\\": %zu, \\"fields\\": {", name, size);',
            "  for (size_t i = 0; i < n; i++)",
            '    printf("%s\\"%s\\": {\\"offset\\": %zu, \\"size\\": %zu, \\"count\\": %zu, '
            '\\"kind\\": \\"%s\\"}", i ? ", " : "", f[i].name, f[i].offset, f[i].size, '
            "f[i].count, f[i].kind);",
            '  printf("}}%s\\n", last ? "" : ",");', "}", "",
            "int main(void) {", '  printf("{\\n");']
    for i, struct in enumerate(structs):
        last = int(i == len(structs) - 1)
        out.append(f"  print_struct(\"{struct}\", sizeof({struct}), F_{struct}, "
                   f"sizeof F_{struct} / sizeof F_{struct}[0], {last});")
    out += ['  printf("}\\n");', "  return 0;", "}", ""]
    return "\n".join(out)


def c_layouts(include_dir, cc, program):
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = pathlib.Path(tmp) / "struct_layout.c", pathlib.Path(tmp) / "struct_layout"
        src.write_text(program)
        cmd = [*cc, "-std=c11", "-pedantic", "-Wall", "-Wextra", "-Werror", f"-I{include_dir}",
               str(src), "-o", str(exe)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"struct_layout.c does not compile:\n{' '.join(cmd)}\n{r.stderr}")
        return json.loads(subprocess.run([str(exe)], capture_output=True, text=True,
                                         check=True).stdout)


def unread_bytes(struct, c):
    """Holes in a C layout that padding does not explain: a field the header reader missed
    (the reader, not the mirrors, would then be wrong). Declaration order is offset order."""
    errors, end, fields = [], 0, list(c["fields"].items())
    for name, f in fields:
        if f["offset"] < end:
            errors.append(f"{struct}.{name}: at {f['offset']}, before the end of the field "
                          f"declared ahead of it ({end}): check_mirrors.py misread the header")
        # No public field is aligned to more than 8 bytes, so a larger hole is a field.
        elif f["offset"] - end >= 8:
            errors.append(f"{struct}: {f['offset'] - end} unread bytes before {name}: "
                          "check_mirrors.py misread the header")
        end = f["offset"] + f["size"]
    if c["size"] - end >= 8:
        errors.append(f"{struct}: {c['size'] - end} unread bytes at the end: check_mirrors.py "
                      "misread the header")
    return errors


def py_kind(t):
    """(kind, element count) of a ctypes field type, in the C program's words."""
    if issubclass(t, ctypes.Array):
        kind, _ = py_kind(t._type_)
        return kind, t._length_
    if issubclass(t, (ctypes._Pointer, ctypes._CFuncPtr)) or t in (ctypes.c_char_p,
                                                                   ctypes.c_void_p,
                                                                   ctypes.c_wchar_p):
        return "pointer", 1
    if issubclass(t, (ctypes.Structure, ctypes.Union)):
        return "struct", 1
    code = getattr(t, "_type_", "?")
    for kind, codes in (("int", "bhilq"), ("uint", "BHILQ"), ("float", "fdg"), ("char", "c")):
        if isinstance(code, str) and code in codes:
            return kind, 1
    return f"ctypes {t.__name__}", 1


def py_fields(cls):
    """Every field of a Structure in layout order, inherited ones first."""
    names = []
    for klass in reversed(cls.__mro__):
        if issubclass(klass, ctypes.Structure) and klass is not ctypes.Structure:
            names += [f[0] for f in klass.__dict__.get("_fields_", [])]
    return names


def py_types(cls):
    types = {}
    for klass in reversed(cls.__mro__):
        types.update({f[0]: f[1] for f in klass.__dict__.get("_fields_", [])})
    return types


def compare(struct, c, cls, whole):
    """Failures of one mirror, each a line naming the struct and the field."""
    errors = []
    where = f"{cls.__module__}.{cls.__qualname__} (mirror of {struct})"
    py_names, types = py_fields(cls), py_types(cls)
    c_names = list(c["fields"])
    if whole:
        for name in c_names:
            if name not in py_names:
                errors.append(f"{where}: field {name} of the C struct is missing")
    elif len(py_names) > len(c_names):
        errors.append(f"{where}: {len(py_names)} fields, the C struct has {len(c_names)}")
    for name in py_names:
        if name not in c["fields"]:
            errors.append(f"{where}: field {name} is not in the C struct")
    common = [n for n in py_names if n in c["fields"]]
    if common != [n for n in c_names if n in py_names] or (
            not whole and py_names != c_names[:len(py_names)]):
        errors.append(f"{where}: fields in another order than C's: {py_names} vs {c_names}")
    for name in common:
        cf, pf = c["fields"][name], getattr(cls, name)
        kind, count = py_kind(types[name])
        if pf.offset != cf["offset"]:
            errors.append(f"{where}: field {name} at offset {pf.offset}, in C at {cf['offset']}")
        if pf.size != cf["size"]:
            errors.append(f"{where}: field {name} of {pf.size} bytes, in C {cf['size']}")
        if (kind, count) != (cf["kind"], cf["count"]):
            errors.append(f"{where}: field {name} is {kind} x{count}, "
                          f"in C {cf['kind']} x{cf['count']}")
    if whole and ctypes.sizeof(cls) != c["size"]:
        errors.append(f"{where}: sizeof {ctypes.sizeof(cls)}, in C {c['size']}")
    return errors


def package_structures():
    """{"module:Class": class} for every ctypes.Structure subclass defined in the package."""
    import libdflash
    found = {}
    for info in pkgutil.iter_modules(libdflash.__path__):
        module = importlib.import_module(f"libdflash.{info.name}")
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if (issubclass(obj, (ctypes.Structure, ctypes.Union))
                    and obj.__module__ == module.__name__):
                found[f"{info.name}:{obj.__qualname__}"] = obj
    return found


def resolve(path):
    """The class a "module:Class" row names, looked up as an attribute so that a name
    re-exported or aliased there (TrainSample = Sample) still resolves; None if absent."""
    module, name = path.split(":")
    try:
        return getattr(importlib.import_module(f"libdflash.{module}"), name, None)
    except ImportError:
        return None


def where_defined(cls):
    return f"{cls.__module__.rpartition('.')[2]}:{cls.__qualname__}"


def main(argv):
    if "--" not in argv:
        print(__doc__)
        return 2
    cc = argv[argv.index("--") + 1:]
    args = argv[1:argv.index("--")]
    include_dir = args[0]
    headers, structs = parse_headers(include_dir)
    program = layout_program(headers, structs)
    if "--print-c" in args:
        print(program)
        return 0
    layouts = c_layouts(include_dir, cc, program)
    mirrors = package_structures()
    errors = [e for struct, c in sorted(layouts.items()) for e in unread_bytes(struct, c)]
    for struct in sorted(set(structs) - set(MIRRORS) - set(UNMIRRORED)):
        errors.append(f"{struct}: a public struct with no Python mirror (add its row to "
                      "MIRRORS, or to UNMIRRORED with the reason)")
    for struct in sorted((set(MIRRORS) | set(UNMIRRORED)) - set(structs)):
        errors.append(f"{struct}: listed in check_mirrors.py but not a public struct")
    rows = [(s, p, True) for s, p in sorted(MIRRORS.items())]
    rows += [(s, p, False) for p, s in sorted(PREFIXES.items())]
    listed, checked = set(), 0
    for struct, path, whole in rows:
        cls = resolve(path)
        if cls is None:
            errors.append(f"{struct}: its mirror libdflash.{path.replace(':', '.')} "
                          "is not in the package (update MIRRORS or PREFIXES)")
            continue
        listed.add(where_defined(cls))
        if struct in layouts:
            errors += compare(struct, layouts[struct], cls, whole)
            checked += 1
    for path in sorted(set(mirrors) - listed):
        errors.append(f"libdflash.{path.replace(':', '.')}: a ctypes.Structure with no row in "
                      "check_mirrors.py's MIRRORS or PREFIXES (which C struct is it?)")
    for line in errors:
        print("FAIL", line)
    print(f"{len(structs)} public structs, {checked} mirrors compared, {len(errors)} failures")
    return 1 if errors or not checked else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
