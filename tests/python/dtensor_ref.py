"""DTensor's own placement arithmetic as a reference: the local tensor a mesh coordinate holds, by torch's
placement `_split_tensor` (what `distribute_tensor` scatters) applied left to right over the mesh dims.
And the FSDP2 model the DCP comparisons fill: a transformers model laid out as its users lay it out."""
import torch
from torch.distributed.tensor import Replicate


def split_reference(full, mesh_shape, placements, coord):
    local = full
    for m, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        chunks, _ = p._split_tensor(local, mesh_shape[m], with_padding=False, contiguous=True)
        local = chunks[coord[m]]
    return local


def sentinel_fsdp_model(config, mesh, fill=-7):
    """A transformers causal LM built on meta, fully_shard per decoder layer and root over `mesh`, given host
    storage and every local shard filled with `fill`: a value no checkpoint holds, so a read that missed a
    byte shows."""
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in model.state_dict().values():
            (t.to_local() if hasattr(t, "to_local") else t).fill_(fill)
    return model
