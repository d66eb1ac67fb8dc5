// runtime/agree/communicator: the narrow seam between shardcast and a transport.
//
// Four kinds of operation, all on raw host (or, for NCCL, device) bytes: broadcast from a root, a send
// to and a receive from one peer, a small all-reduce (sum of int64s, for verdicts), and barrier. Every
// operation waits at most `timeout`. After any timeout or error the communicator is finished: every later
// call throws kComm naming the first failure, so a half-failed collective is never reused.
//
// Implementations: c10d (Gloo on CPU, from a TCPStore rendezvous or the caller's process group) and,
// in CUDA builds, NCCL with its unique id exchanged through the same store.
//
// Thread safety: one thread drives a communicator; SendAsync work may complete on others.
// Failure: kCommTimeout (a peer stalled or died without closing), kComm (a peer died, connection lost).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "allocators/error.h"

namespace shardcast {

// Where a rank finds its peers: torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or SLURM's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
// SLURM_NTASKS_PER_NODE; MASTER_ADDR/MASTER_PORT still needed, or SLURM_LAUNCH_NODE_IPADDR).
struct Rendezvous {
  int rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int listen_fd = -1;  // rank 0: a socket already listening on master_port (SHARDCAST_LISTEN_FD), or -1
  std::string source;  // "torchrun", "slurm" or "default" (single process)
};
// Throws kInvalidArgument naming the variable on bad values. The one parser of these variables
// (runtime/launch_env.cc): SLURM_NTASKS_PER_NODE in any of SLURM's list forms ("8", "8(x2)", "2(x3),1"),
// this node's count picked by SLURM_NODEID.
Rendezvous RendezvousFromEnvironment();

// Where a rendezvous store listens, for the probe of a store that did not answer in time (a port that refuses
// a connect: its host is gone; runtime/comm/store_channel.h). port < 0: not known, and such a store is taken
// as silent.
struct StoreAddress {
  std::string addr;
  int port = -1;
  // addr's numeric addresses, resolved once while the store answered (runtime/comm/store_channel.h:
  // Resolved); the probe then asks no name service. Empty: addr is resolved when probed.
  std::vector<std::string> numeric = {};
};

// A pending send; Wait throws like the collectives do. Destroying it, waited for or not, ends the
// transport's use of the bytes: once the destructor returns the transport neither reads them nor will
// (a send not yet completed is cancelled, a write in progress waited out). So its bytes may be freed
// after it, never before; Abort alone does not promise this. Gloo: the send's unbound buffer dies with
// the c10d work, and gloo's pairs drop operations on a buffer that is gone.
class PendingSend {
 public:
  virtual ~PendingSend() = default;
  virtual void Wait() = 0;
};

struct FailureNote {
  ErrorKind kind = ErrorKind::kComm;
  std::string message;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string backend() const = 0;

  virtual void Broadcast(void* data, uint64_t bytes, int root) = 0;
  // The sender: SendAsync(bytes to `peer`); that peer: Recv(bytes from the sender, its `peer`). A
  // stream's messages are a sequence of these, in an order every rank derives from the manifest.
  virtual std::unique_ptr<PendingSend> SendAsync(const void* data, uint64_t bytes, int peer) = 0;
  virtual void Recv(void* data, uint64_t bytes, int peer) = 0;
  virtual void AllReduceSum(int64_t* values, uint64_t count) = 0;
  virtual void Barrier() = 0;

  virtual std::chrono::milliseconds timeout() const = 0;
  // Where the buffers passed to Broadcast/SendAsync/Recv must live: host memory for Gloo, the device
  // for NCCL (the stream then stages through device buffers).
  virtual bool device_buffers() const { return false; }

  // A side channel for the first failure, through the rendezvous store, so every rank can raise the
  // same error. Every store operation here has a deadline: a store whose host (rank 0, for a store
  // shardcast made) is frozen or gone answers with a note saying so, the same on every rank:
  //   kCommTimeout "<store host> did not answer: it is frozen or unreachable"
  //   kComm        "<store host> is lost: its connection closed or its port refuses connections"
  // (runtime/comm/store_channel.h: StoreSilent, StoreLost, and the probe that picks one, StoreUnanswered)
  // PublishFailure stores `mine` unless a failure is already there and returns the one that stands;
  // FetchFailure waits at most `wait` for one. No store: nullopt from both.
  virtual std::optional<FailureNote> PublishFailure(const FailureNote& mine) { return std::nullopt; }
  virtual std::optional<FailureNote> FetchFailure(std::chrono::milliseconds wait) { return std::nullopt; }
  // The publisher (usually rank 0, which hosts the store) waits until `n` ranks fetched, or `wait`.
  virtual void AwaitFailureAcks(int n, std::chrono::milliseconds wait) {}
  // Tears the transport down so peers blocked on us fail fast instead of waiting out their timeout.
  // Sends still pending are not cancelled by it: destroy them (PendingSend) before freeing their bytes.
  virtual void Abort() = 0;
};

// Gloo through libtorch's c10d, rendezvous over a TCPStore at master_addr:master_port, within a
// deadline a little past `timeout`. `phase` names the operation in the error a worker raises when rank
// 0 is lost or frozen during the rendezvous: the same error as a peer that lost it later in that phase.
// The group's first collective, a barrier that readies it on every rank, is already that phase: a failure
// in it is the phase's one agreed error (FailTogether), whichever rank failed first. A rank whose own
// making of the group fails (rank 0, the store host, too) publishes its error, and every other rank, still
// inside gloo's wait for its address, takes it within about a second (a watch over a second connection).
std::unique_ptr<Communicator> CreateGlooCommunicator(const Rendezvous& rv, std::chrono::milliseconds timeout,
                                                     const char* phase = "load");

// A single-process communicator for world size 1: every operation is local.
std::unique_ptr<Communicator> CreateLocalCommunicator();

// NCCL, in CUDA builds: the unique id goes through a TCPStore at the same rendezvous. Buffers are
// device memory on `device`. Throws kUnsupported in builds without CUDA or where no device is usable.
std::unique_ptr<Communicator> CreateNcclCommunicator(const Rendezvous& rv, std::chrono::milliseconds timeout, int device);

}  // namespace shardcast
