#!/usr/bin/env python3
"""Lists the tests a ctest run skipped and why, grouped by reason, from ctest's --output-junit file.

Usage: scripts/skipped_tests.py JUNIT.xml
A gtest skip prints "FILE:LINE: Skipped" and then its message; ctest marks the test skipped (gtest
tests are discovered with SKIP_REGULAR_EXPRESSION set) and keeps that output in the junit file.
"""
import collections
import sys
import xml.etree.ElementTree as ElementTree


def skip_reason(output):
    lines = (output or "").splitlines()
    for index, line in enumerate(lines):
        if line.endswith(": Skipped"):
            message = []
            for follow in lines[index + 1:]:
                if follow.startswith("[  SKIPPED ]"):
                    break
                message.append(follow.strip())
            return " ".join(part for part in message if part) or "(no message)"
    return "(no message)"


def main():
    tree = ElementTree.parse(sys.argv[1])
    by_reason = collections.defaultdict(list)
    for case in tree.getroot().iter("testcase"):
        if case.find("skipped") is None:
            continue
        output = case.find("system-out")
        by_reason[skip_reason(output.text if output is not None else "")].append(case.get("name"))
    total = sum(len(names) for names in by_reason.values())
    if not total:
        print("test: no test skipped")
        return
    print(f"test: {total} test{'' if total == 1 else 's'} skipped:")
    for reason, names in sorted(by_reason.items(), key=lambda item: -len(item[1])):
        shown = ", ".join(names[:4]) + (f", and {len(names) - 4} more" if len(names) > 4 else "")
        print(f"  {len(names)} × {reason}\n      {shown}")


if __name__ == "__main__":
    main()
