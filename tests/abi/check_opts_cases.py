#!/usr/bin/env python3
"""Every public struct with a struct_size is checked by test_opts.c (the versioned-struct
rule, src/core/opts.c): fails naming each struct of include/dflash/ that has no row in its
CASES table.   check_opts_cases.py INCLUDE_DFLASH_DIR TEST_OPTS_C"""
import pathlib
import re
import sys


def versioned_structs(folder):
    names = set()
    for header in sorted(pathlib.Path(folder).glob("*.h")):
        text = re.sub(r"/\*.*?\*/", " ", header.read_text(), flags=re.S)
        for m in re.finditer(r"typedef struct (dflash_\w+) \{(.*?)\}\s*\1;", text, flags=re.S):
            if re.search(r"\bsize_t struct_size;", m.group(2)):
                names.add(m.group(1))
    return names


def cases(test_c):
    text = pathlib.Path(test_c).read_text()
    table = text[text.index("static const opts_case CASES[]"):]
    table = table[:table.index("};")]
    return set(re.findall(r'\{"(dflash_\w+)",', table))


def main():
    structs, checked = versioned_structs(sys.argv[1]), cases(sys.argv[2])
    if not structs:
        print("no versioned structs found in", sys.argv[1])
        return 1
    missing = sorted(structs - checked)
    for name in missing:
        print(f"{name} has a struct_size but no case in test_opts.c (add its row to CASES)")
    unknown = sorted(checked - structs)
    for name in unknown:
        print(f"test_opts.c checks {name}, which is not a public struct with struct_size")
    print(f"{len(structs)} versioned public structs, {len(checked & structs)} checked")
    return 1 if missing or unknown else 0


if __name__ == "__main__":
    sys.exit(main())
