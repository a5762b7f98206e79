#!/usr/bin/env python3
"""The library exports exactly the functions declared DFLASH_API in the public headers, and
the version script (src/libdflash.map) names each of them once, explicitly, in the node
of the release that added it (libbpf's practice: one node per release, no globs).

Usage: check_symbols.py LIB INCLUDE_DIR MAP SUPPRESSIONS
Fails (exit 1) naming each symbol that is declared but not exported, exported but not
declared, exported but missing from the map, listed in the map but not exported, listed
twice, or exported under a version other than its node's; and on any glob but the final
`local: *;`. The map's DFLASH_EXPERIMENTAL node, the functions experimental.h declares and
the names abi/suppressions leaves out of the baseline check must be the same set.
"""
import pathlib
import re
import subprocess
import sys


EXPERIMENTAL_NODE, EXPERIMENTAL_HEADER = "DFLASH_EXPERIMENTAL", "experimental.h"


def declared_functions(include_dir, pattern="*.h"):
    names = set()
    for header in sorted(include_dir.glob(pattern)):
        text = re.sub(r"/\*.*?\*/", " ", header.read_text(), flags=re.S)  # comments name functions too
        for m in re.finditer(r"\bDFLASH_API\b([^;{]*)", text):
            decl = m.group(1)
            # `T (dflash_x)(...)`: a name kept beside a function-like macro of the same name.
            f = re.search(r"\((dflash_\w+)\)\s*\(", decl) or re.search(r"\b(dflash_\w+)\s*\(", decl)
            if f:
                names.add(f.group(1))
    return names


def exported_symbols(lib):
    """{name: version node} of the library's defined dynamic symbols (nm -D prints
    name@@NODE for a symbol's default version)."""
    nm = subprocess.run(["nm", "-D", "--defined-only", lib], check=True, capture_output=True,
                        text=True)
    out = {}
    for line in nm.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "TDBRWVtdbr":
            name, _, version = parts[2].partition("@")
            out[name] = version.lstrip("@")
    return out  # the version nodes themselves are absolute ('A') symbols, not listed


def parse_map(path):
    """[(node, [symbols], parent)] and the problems found in the script's layout."""
    text = re.sub(r"/\*.*?\*/", " ", pathlib.Path(path).read_text(), flags=re.S)
    nodes, problems = [], []
    for m in re.finditer(r"(\w[\w.]*)\s*\{(.*?)\}\s*([\w.]*)\s*;", text, flags=re.S):
        node, body, parent = m.group(1), m.group(2), m.group(3) or None
        syms, scope = [], None
        for item in (s.strip() for s in body.split(";")):
            if not item:
                continue
            head, colon, rest = item.partition(":")
            if colon:
                scope, item = head.strip(), rest.strip()
                if not item:
                    continue
            if scope == "local":
                if item != "*":
                    problems.append(f"{node}: local symbol {item} (only 'local: *;' belongs here)")
                continue
            if any(c in item for c in "*?["):
                problems.append(f"{node}: glob '{item}' (list every symbol by name)")
                continue
            syms.append(item)
        nodes.append((node, syms, parent))
    if not nodes:
        problems.append(f"{path}: no version node found")
    return nodes, problems


def suppressed_names(path):
    """The function names of abi/suppressions' [suppress_function] sections."""
    return set(re.findall(r"^\s*name\s*=\s*(\w+)\s*$", pathlib.Path(path).read_text(), flags=re.M))


def experimental_problems(include_dir, nodes, supp_path):
    in_header = declared_functions(include_dir, EXPERIMENTAL_HEADER)
    in_node = {s for n, syms, _ in nodes if n == EXPERIMENTAL_NODE for s in syms}
    in_supp = suppressed_names(supp_path)
    if in_header == in_node == in_supp:
        return []
    return [f"{EXPERIMENTAL_HEADER} declares {sorted(in_header)}, the map's {EXPERIMENTAL_NODE} "
            f"node lists {sorted(in_node)}, {supp_path} suppresses {sorted(in_supp)}: one set"]


def main():
    lib, include_dir, map_path = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
    supp_path = sys.argv[4]
    declared = declared_functions(include_dir)
    exported = exported_symbols(lib)
    nodes, problems = parse_map(map_path)
    in_map = {}
    for node, syms, _ in nodes:
        for s in syms:
            if s in in_map:
                problems.append(f"{s}: listed in {in_map[s]} and again in {node}")
            in_map.setdefault(s, node)
    known = {n for n, _, _ in nodes}
    for node, _, parent in nodes:
        if parent and parent not in known:
            problems.append(f"{node}: inherits unknown node {parent}")

    report = [
        ("declared DFLASH_API but not exported", sorted(declared - exported.keys())),
        ("exported but not declared DFLASH_API", sorted(exported.keys() - declared)),
        ("exported but missing from " + map_path, sorted(exported.keys() - in_map.keys())),
        ("listed in the map but not exported", sorted(in_map.keys() - exported.keys())),
        ("exported under another version than its map node",
         sorted(f"{s}@{v} (map: {in_map[s]})" for s, v in exported.items()
                if s in in_map and v != in_map[s])),
        ("version script layout", problems),
        ("experimental calls", experimental_problems(include_dir, nodes, supp_path)),
    ]
    bad = False
    for title, items in report:
        if items:
            bad = True
            print(title + ":", *items, sep="\n  ")
    print(f"{len(declared)} declared, {len(exported)} exported, {len(in_map)} in "
          f"{len(nodes)} version node(s)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
