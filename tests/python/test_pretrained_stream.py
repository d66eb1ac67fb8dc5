"""from_pretrained's set-up, phase by phase: what each rank spent on import, config, build, layout,
stream and wait, in the report every rank returns.

Real transformers checkpoints (llama with tied embeddings, qwen3_moe; dims that do not divide by the world
size) saved by save_pretrained, loaded by real rank processes over c10d Gloo, each launch with a deadline.
"""
import pytest

import ranks

PHASES = {"import", "config", "build", "layout", "stream", "wait"}


@pytest.fixture(scope="module")
def run(tiny_checkpoints, tmp_path_factory):
    root = tiny_checkpoints("tied", models=("llama", "qwen3_moe"))
    return ranks.Scenarios("pretrained_stream_worker.py", tmp_path_factory, {3: ["phases"]}, root=root, timeout=300)


def test_every_rank_reports_every_rank_phases_adding_up_to_its_total(run):
    results = run("phases", 3)
    for name in ("llama", "qwen3_moe"):
        every = [r[name] for r in results]
        assert all(e["dict"] == every[0]["dict"] for e in every), f"{name}: the ranks' reports differ"
        for rank, row in enumerate(every[0]["typed"]):
            assert row["rank"] == rank and set(row["phases"]) == PHASES, (name, row)
            assert all(s >= 0 for s in row["phases"].values()), (name, row)
            assert row["total"] > 0 and abs(sum(row["phases"].values()) - row["total"]) <= 0.01 * row["total"] + 0.01, \
                (name, row)
            # The load is the stream phase, seen from inside: it cannot take longer than the phase around it.
            assert row["phases"]["stream"] >= row["load_seconds"] > 0, (name, row)
            assert every[0]["dict"][rank]["phases"] == row["phases"], (name, rank)
