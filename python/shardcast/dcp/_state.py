"""StorageWriter and StorageReader: a whole training state (model, optimizer, scheduler, DCP's byte items)
behind torch.distributed.checkpoint, stored as safetensors plus JSON. Nothing on disk is a pickle.

    import torch.distributed.checkpoint as dcp
    from shardcast.dcp import StorageReader, StorageWriter

    dcp.save(state, storage_writer=StorageWriter(path))
    dcp.load(state, storage_reader=StorageReader(path))

They stand where torch's FileSystemWriter / FileSystemReader stand; DCP's planner still flattens, dedups
and reshards. The directory:

    path/
      __0_0.safetensors     rank 0's chunks, each a contiguous tensor "<fqn>@<offsets>" (a DTensor's local
      __1_0.safetensors     shard, an optimizer moment's shard, a scalar step), and its byte items, each a
      ...                   uint8 tensor "<fqn>" holding the value as tagged JSON (below)
      .metadata.json        DCP's Metadata as JSON, written last by the coordinator (tmp + fsync + rename):
                            a directory without it is not a checkpoint, so a killed save never looks done

  one rank file:  [u64 n][header: n bytes of JSON, space-padded][tensor 0 bytes][tensor 1 bytes]...
                         {"<fqn>@0,0": {"dtype": "F32", "shape": [8, 32], "data_offsets": [0, 1024]}, ...}

Byte items. DCP hands a writer every non-tensor value (an lr, betas, a scheduler's last_epoch, a
dataloader's state) as torch.save bytes: a pickle. The writer decodes them with torch's weights-only
unpickler (plain data only, no code runs) and stores the value as tagged JSON; the reader rebuilds it and
hands DCP's planner fresh torch.save bytes of it. A value that is not plain data (an object of the user's
own class) is refused with Unsupported, unless `allow_pickle=True` is given to the writer (the bytes are
then stored as they are, marked "torch.save") and to the reader (which otherwise refuses to unpickle them).

Failures raise a shardcast exception (CheckpointError for a bad checkpoint, IoError for a failed write,
Unsupported for a value JSON cannot hold) naming the file, key and rank. DCP gathers every rank's exception
in its plan, write and read steps and raises its CheckpointException on every rank; these classes run no
collective of their own, so nothing here can leave a rank waiting.

Here the format; the writer is in _state_writer, the reader in _state_reader, the metadata's JSON in
_state_codec, the byte items' values as tagged JSON in _state_values, the rank files' layout, writes and reads in _state_files.
"""
from ._state_reader import StorageReader  # noqa: F401
from ._state_writer import StorageWriter  # noqa: F401
