"""DTensor's own placement arithmetic as a reference: the local tensor a mesh coordinate holds, by torch's
placement `_split_tensor` (what `distribute_tensor` scatters) applied left to right over the mesh dims."""
from torch.distributed.tensor import Replicate


def split_reference(full, mesh_shape, placements, coord):
    local = full
    for m, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        chunks, _ = p._split_tensor(local, mesh_shape[m], with_padding=False, contiguous=True)
        local = chunks[coord[m]]
    return local
