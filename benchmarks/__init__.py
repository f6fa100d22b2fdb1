"""Benchmark suites: ``python -m benchmarks <suite> [--quick] [--out DIR]``.

A suite named ``foo-bar`` is the module ``benchmarks.foo_bar`` exposing
``run(quick: bool, out: Path) -> dict``; it writes ``out/foo-bar.json``, ``out/foo-bar.md``
and its plots itself (helpers in ``benchmarks.report``).
"""
