"""The ids of vLLM's tests/v1/core tests that pass, from pytest's junit xml: record them, or check
that a run passed every recorded one.

    python .ci/vllm_core_tests.py record JUNIT_XML PASSING_TXT   # from a run with vLLM's own pool
    python .ci/vllm_core_tests.py check JUNIT_XML PASSING_TXT    # a run with kvcached's pool

An id is junit's ``classname::name`` (e.g. ``tests.v1.core.test_prefix_caching::test_evict[1]``),
one a line, sorted; only ids are kept in this repository, no vLLM code. ``check`` fails, naming
them, when a recorded test did not pass (failed, errored, skipped or was not collected); tests
that pass with kvcached's pool but not with vLLM's are reported and allowed.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HEADER = ("# vLLM {version}: the tests of its tests/v1/core that pass with vLLM's own BlockPool on a CPU\n"
          "# (junit classname::name). Regenerate: .ci/vllm_core_passing {version}\n")


def outcomes(junit_xml: Path) -> dict[str, str]:
    """Test id -> "passed", "failed", "error" or "skipped", for every test case in the file."""
    root = ET.parse(junit_xml).getroot()
    result: dict[str, str] = {}
    for case in root.iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        result[test_id] = kinds[0].replace("failure", "failed") if kinds else "passed"
    if not result:
        raise SystemExit(f"{junit_xml}: no test cases (did pytest collect vLLM's tests?)")
    return result


def read_ids(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def record(junit_xml: Path, passing_txt: Path, version: str) -> None:
    results = outcomes(junit_xml)
    passed = sorted(test_id for test_id, outcome in results.items() if outcome == "passed")
    passing_txt.write_text(HEADER.format(version=version) + "".join(f"{test_id}\n" for test_id in passed))
    print(f"{passing_txt}: {len(passed)} of {len(results)} tests pass with vLLM's pool")


def check(junit_xml: Path, passing_txt: Path) -> None:
    results = outcomes(junit_xml)
    expected = read_ids(passing_txt)
    if not expected:
        raise SystemExit(f"{passing_txt} lists no test: regenerate it with .ci/vllm_core_passing")
    missing = [(test_id, results.get(test_id, "not run")) for test_id in expected
               if results.get(test_id) != "passed"]
    extra = sorted(set(test_id for test_id, outcome in results.items() if outcome == "passed") - set(expected))
    passed = sum(1 for outcome in results.values() if outcome == "passed")
    print(f"vLLM's tests/v1/core with kvcached's pool: {passed} of {len(results)} passed; "
          f"{len(expected) - len(missing)} of the {len(expected)} that pass with vLLM's pool")
    if extra:
        print(f"{len(extra)} pass with kvcached's pool only (not recorded): {', '.join(extra[:10])}")
    if missing:
        lines = "\n".join(f"  {test_id}: {outcome}" for test_id, outcome in missing)
        raise SystemExit(f"{len(missing)} tests that pass with vLLM's own pool do not with kvcached's:\n{lines}")


def main(argv: list[str]) -> None:
    if len(argv) != 4 or argv[1] not in ("record", "check"):
        raise SystemExit(__doc__)
    junit_xml, passing_txt = Path(argv[2]), Path(argv[3])
    if argv[1] == "record":
        version = passing_txt.name.removeprefix("vllm-").split("-core-passing")[0]
        record(junit_xml, passing_txt, version)
    else:
        check(junit_xml, passing_txt)


if __name__ == "__main__":
    main(sys.argv)
