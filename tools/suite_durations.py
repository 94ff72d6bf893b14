"""Where a test suite's time goes: per folder of tests/, from pytest's junit XML.

    JUNIT_DIR=runs/junit bash tests/run.sh
    python tools/suite_durations.py runs/junit/mcore016.xml runs/junit/mcore019.xml

Prints one JSON object: for each file, its tests (run, skipped, failed), the seconds they took
(the sum of the tests' own times: fixtures included, collection and start-up not) and the same per
folder (``tests`` for top-level modules, ``tests/training``, ...), largest first.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import xml.etree.ElementTree as ET  # the suite's own XML (pytest wrote it), not untrusted input


def folder_of(classname: str) -> str:
    """``tests.training.test_trainer`` (or ``tests.training.test_trainer.TestX``) -> ``tests/training``."""
    parts = classname.split(".")
    module = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
    return "/".join(parts[:module]) or "tests"


def durations(path: str) -> dict:
    cases = list(ET.parse(path).getroot().iter("testcase"))
    seconds, counts = collections.Counter(), collections.Counter()
    skipped = failed = 0
    for case in cases:
        folder = folder_of(case.get("classname", ""))
        seconds[folder] += float(case.get("time", 0.0))
        counts[folder] += 1
        skipped += case.find("skipped") is not None
        failed += case.find("failure") is not None or case.find("error") is not None
    return {"tests": len(cases), "skipped": skipped, "failed": failed,
            "seconds": round(sum(seconds.values()), 1),
            "folders": {f: {"tests": counts[f], "seconds": round(s, 1)} for f, s in seconds.most_common()}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("junit", nargs="+", help="junit XML files (pytest --junitxml)")
    args = p.parse_args(argv)
    missing = [f for f in args.junit if not os.path.isfile(f)]
    if missing:
        raise SystemExit(f"error: {missing[0]} is not a file")
    print(json.dumps({os.path.basename(f): durations(f) for f in args.junit}, indent=1))


if __name__ == "__main__":
    main()
