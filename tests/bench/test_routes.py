"""``python -m bench.routes``: both routes measured on a real conveyor (redis-server, the
gateway, a worker), every request answered 200 (202 for a job's submission; a failed one
ends the bench), and a row per figure with a value per round and the second route against
the first."""

from __future__ import annotations

import pytest

from bench.routes import VECTOR, Instant, main


def test_the_stage_answers_every_text_at_once() -> None:
    assert Instant().predict([{"text": "a"}, {"text": "b"}]) == [{"embedding": VECTOR}] * 2
    assert len(VECTOR) == 384


@pytest.mark.parametrize("routes", ["native,openai", "native,jobs"])
def test_both_routes_are_measured_in_turn(routes: str, capsys: pytest.CaptureFixture[str]) -> None:
    # A job's submission succeeds with a 202 (counted as such, not as a failure).
    main(
        [
            "--routes",
            routes,
            "--rounds",
            "2",
            "--seconds",
            "0.5",
            "--warmup",
            "0.2",
            "--clients",
            "4",
            "--requests",
            "60",
        ]
    )
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) >= {"req/s", "p50 ms", "gateway CPU µs/request"}
    for name in ("req/s", "p50 ms", "gateway CPU µs/request"):
        cells = [c.strip() for c in rows[name].strip("|").split("|")]
        first, second, ratio = cells[1:]
        for cell in (first, second):
            rounds = cell.split("(")[1].rstrip(")").split(", ")
            assert len(rounds) == 2, cell
            assert all(float(v) > 0 for v in rounds), cell
        assert ratio.endswith("x")
        assert float(ratio[:-1]) > 0


def test_an_unknown_route_is_refused_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--routes", "native,grpc"])
    assert "grpc" in capsys.readouterr().err
