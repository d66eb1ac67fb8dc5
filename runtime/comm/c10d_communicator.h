// runtime/comm/c10d_communicator: a Communicator over any c10d Backend (Gloo here; NCCL's for device
// buffers): one shardcast creates (CreateGlooCommunicator for the CLI; CreateGlooCommunicatorOnStore
// over the caller's store, for Python's load and save), or the caller's own (WrapC10dBackend; shardcast
// then cannot abort it, so a failed rank's peers wait out the timeout).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "runtime/agree/communicator.h"

namespace shardcast {

// device: where buffers live (CPU for Gloo). The backend's rank and size are the communicator's.
// store: the group's store, for the failure side channel (may be null); store_host names who serves
// it in messages ("rank 0 (the store host at 10.0.0.1:29500)").
std::unique_ptr<Communicator> WrapC10dBackend(c10::intrusive_ptr<c10d::Backend> backend, std::chrono::milliseconds timeout,
                                              c10::intrusive_ptr<c10d::Store> store = {},
                                              c10::Device device = c10::Device(c10::kCPU),
                                              std::string store_host = "the process group's store");

// A Gloo group of its own for one load or save, made by `world_size` ranks over the caller's `store`
// (give each operation its own prefix of one store per caller's group: its failure note and Gloo's
// rendezvous keys live there). It is owned, so a rank that fails aborts it and the peers blocked on that
// rank fail at once, while the caller's process groups are never touched and stay usable. Every rank's
// group is up before any returns: a new group's first collective is a barrier, under the failure agreement
// of `phase` (a rank that fails in it, or a peer's failure that reaches it there, is that phase's one
// agreed error, as FailTogether raises it). Ranks that do not come within `timeout` are one CommTimeout on
// every rank that did, naming those that did not; a store that stops answering, or a rank lost while the
// group is made, is a CommTimeout naming `store_host` after RendezvousDeadline(timeout). GLOO_SOCKET_IFNAME
// picks the interface; a loopback MASTER_ADDR, loopback. Where every rank still holds the group the previous
// operation over the same store left (KeepGlooGroup: it ended well on every rank, with this rank, world size
// and timeout), the ranks agree over `store` to use it again instead of making one. `absent`: ranks this rank
// already waited `timeout` for in this operation (an exchange before it timed out naming them); where none
// of them has come to the group's vote, this rank decides it at once ("absent <ranks>": the same CommTimeout
// on every rank) instead of waiting a second timeout.
std::unique_ptr<Communicator> CreateGlooCommunicatorOnStore(c10::intrusive_ptr<c10d::Store> store, int rank,
                                                            int world_size, std::chrono::milliseconds timeout,
                                                            std::string store_host, std::vector<int> absent = {},
                                                            const char* phase = "load");

// After an operation that ended well on this rank: its Gloo group (one CreateGlooCommunicatorOnStore
// made, and not aborted) is kept for the next operation over the same caller's store. Anything else is
// simply destroyed.
void KeepGlooGroup(std::unique_ptr<Communicator> comm);

// Drops every kept group (the caller's process groups are gone: torch.distributed was shut down).
void ForgetGlooGroups();

// "rank 0 (the store host at ADDR:PORT)": the store a Rendezvous makes, for failure messages; StoreAt: where
// it listens, for the probe of a store that did not answer (StoreUnanswered).
std::string StoreHost(const Rendezvous& rv);
StoreAddress StoreAt(const Rendezvous& rv);

// A write to a socket whose peer died raises SIGPIPE, whose default action ends the process with no
// report (c10d's store client and gloo do not all pass MSG_NOSIGNAL). Where SIGPIPE still has its
// default action, it is ignored, so the write fails with EPIPE and becomes the error every rank
// agrees on. Python already ignores it; a handler the program installed is left alone.
void IgnoreBrokenPipes();

// How long a rendezvous may take before its store host counts as frozen: a little past `timeout`,
// the longest any one store read waits for a late peer.
std::chrono::milliseconds RendezvousDeadline(std::chrono::milliseconds timeout);

// The error for an exception out of a rendezvous: on a worker, a broken or refused connection to the
// store is rank 0 lost (StoreLost/StoreSilent, under `phase`); anything else names the rendezvous.
Error RendezvousError(const Rendezvous& rv, const char* phase, const std::exception& e);

}  // namespace shardcast
