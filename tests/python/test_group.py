"""shardcast over a process group that has no CPU backend (an NCCL-only group): its Gloo twin is
created once per group, by that group's ranks only, and released once the group is gone."""
import torch
from safetensors.torch import save_file

import ranks


# Regression (issue 20): every load and save called dist.new_group(backend="gloo"), which is collective
# over the whole world: ranks 0 and 1 loading through a subgroup hung waiting for rank 2, which never
# calls shardcast; and each call made a new group that was never destroyed.
def test_a_subgroup_without_a_cpu_backend_gets_one_gloo_twin_of_its_own_ranks(tmp_path):
    torch.manual_seed(0)
    save_file({"w": torch.randn(7, 3)}, str(tmp_path / "model.safetensors"))
    results = ranks.run("group_worker.py", "subgroup", tmp_path, 3, tmp_path, timeout=120)
    for rank, r in enumerate(results):
        assert r["world"], f"rank {rank}: the world load after the subgroup was destroyed is wrong"
        assert r["world_group_sum"] == 3, r
        assert r["twins_after"] == 0, f"rank {rank}: the twin of the destroyed subgroup was not released"
    for rank, r in enumerate(results[:2]):
        assert r["sub_has_cpu_backend"] is False, "the test group must lack a CPU backend"
        assert r["first"] and r["second"], f"rank {rank}: rows differ"
        assert r["twins"] == 1 and r["same_twin"], r
        assert r["registry_unchanged"], f"rank {rank}: shardcast registered a c10d group or moved the counter"
