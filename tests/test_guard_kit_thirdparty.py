"""The guard kit as a third party meets it: a package of its own, the plugin, a fixture.

``tests/kit_thirdparty`` is a throwaway guard package that imports only public names. It
runs in a pytest of its own (a subprocess in a fresh folder, the plugin loaded with ``-p
fence.testing.guards``) and passes the kit; each of three mutants of it fails, in the
tests that check what the mutant breaks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

PACKAGE = Path(__file__).parent / "kit_thirdparty"


def _run(pytester: pytest.Pytester, mutant: str) -> tuple[dict[str, int], set[str]]:
    pytester.makepyfile(
        toyguard=(PACKAGE / "toyguard.py").read_text(),
        test_toyguard=(PACKAGE / "check_toyguard.py").read_text(),
    )
    pytester.makeini("[pytest]\npythonpath = .\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOYGUARD_MUTANT", mutant)
        result = pytester.runpytest_subprocess(
            "-p", "fence.testing.guards", "-p", "no:cacheprovider", "-q", "-rf"
        )
    failed = {
        line.split()[1].split("::")[-1].split("[")[0]
        for line in result.outlines
        if line.startswith("FAILED ")
    }
    return result.parseoutcomes(), failed


def test_the_package_imports_only_public_names() -> None:
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fence"):
                assert node.module in ("fence", "fence.testing.guards"), (path, node.module)
                assert not any(a.name.startswith("_") for a in node.names), path


def test_the_toy_guard_passes_the_kit(pytester: pytest.Pytester) -> None:
    outcomes, failed = _run(pytester, "")
    assert failed == set()
    assert outcomes.get("passed", 0) == 26, outcomes  # 13 tests, sync and asyncio


@pytest.mark.parametrize(
    ("mutant", "caught_by"),
    [
        pytest.param(
            "older",
            {
                "test_c4_accepts_iff_token_not_below_fence",
                "test_c5_rejection_changes_nothing_and_says_why",
                "test_c6_batch_is_all_or_nothing",
                "test_c7_delete_leaves_a_tombstone",
                "test_c8_claim_shuts_out_older_tokens_without_writing",
                "test_c8_registering_read_raises_the_fence",
                "test_errors_pickle_with_their_data",
                "test_agrees_with_the_memory_guard",
            },
            id="accepts-an-older-token",
        ),
        pytest.param(
            "half-batch",
            {"test_c6_batch_is_all_or_nothing", "test_agrees_with_the_memory_guard"},
            id="half-applies-a-batch",
        ),
        pytest.param(
            "write-on-refusal",
            {
                "test_c4_accepts_iff_token_not_below_fence",
                "test_c5_rejection_changes_nothing_and_says_why",
                "test_c7_delete_leaves_a_tombstone",
                "test_stale_holder_is_refused_on_every_path",
                "test_agrees_with_the_memory_guard",
            },
            id="writes-on-refusal",
        ),
    ],
)
def test_a_mutant_fails_the_kit(
    pytester: pytest.Pytester, mutant: str, caught_by: set[str]
) -> None:
    outcomes, failed = _run(pytester, mutant)
    assert failed == caught_by
    assert outcomes["failed"] == 2 * len(caught_by)  # sync and asyncio
