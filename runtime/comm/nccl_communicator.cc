// The NCCL communicator (CUDA builds). Every operation is issued non-blocking on a stream of its own
// and polled until it completes, fails (ncclCommGetAsyncError) or runs past the timeout, when the
// communicator is aborted (ncclCommAbort) and finished: no NCCL call is ever left to hang.
#include "runtime/agree/communicator.h"
#include "shardcast_config.h"

#if SHARDCAST_HAVE_CUDA

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstring>
#include <thread>

#include "runtime/comm/c10d_backend.h"
#include "runtime/comm/c10d_communicator.h"
#include "runtime/comm/store_channel.h"

namespace shardcast {
namespace {

using Clock = std::chrono::steady_clock;

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(const Rendezvous& rv, std::chrono::milliseconds timeout, int device)
      : rank_(rv.rank), size_(rv.world_size), timeout_(timeout), device_(device) {
    Cuda(cudaSetDevice(device_), "cudaSetDevice(" + std::to_string(device_) + ")");
    IgnoreBrokenPipes();
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(rv.master_port);
    so.isServer = rv.rank == 0;
    so.numWorkers = rv.world_size;
    so.timeout = timeout;
    if (rv.rank == 0 && rv.listen_fd >= 0) so.masterListenFd = rv.listen_fd;
    // The TCPStore client reads with no deadline of its own: a frozen rank 0 would hold us forever.
    const std::string addr = rv.master_addr;
    using Met = std::pair<c10::intrusive_ptr<c10d::Store>, std::vector<uint8_t>>;
    std::function<Met()> rendezvous = [so, addr, rank = rank_]() -> Met {  // owns all it touches
      auto store = c10::make_intrusive<c10d::PrefixStore>("shardcast-nccl", c10::make_intrusive<c10d::TCPStore>(addr, so));
      std::vector<uint8_t> v;
      if (rank == 0) {
        ncclUniqueId id;
        const ncclResult_t rc = ncclGetUniqueId(&id);
        if (rc != ncclSuccess) throw Error(ErrorKind::kComm, "ncclGetUniqueId", ncclGetErrorString(rc));
        v.assign(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof(id));
        store->set("id", v);
      } else {
        v = store->get("id");  // waits up to the store's timeout for rank 0
      }
      return Met{store, std::move(v)};
    };
    std::optional<Met> met;
    try {
      met = WithDeadline(std::move(rendezvous), RendezvousDeadline(timeout));
    } catch (const std::exception& e) {
      throw RendezvousError(rv, "load", e);
    }
    if (!met) {
      const FailureNote n = StoreUnanswered(StoreHost(rv), StoreAt(rv));
      throw Error(n.kind, "load", n.message);
    }
    store_ = met->first;
    channel_ = std::make_unique<StoreChannel>(store_, StoreHost(rv), StoreAt(rv));
    ncclUniqueId id;
    std::memcpy(&id, met->second.data(), std::min(met->second.size(), sizeof(id)));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    Nccl(ncclCommInitRankConfig(&comm_, size_, id, rank_, &config), "ncclCommInitRankConfig");
    Poll("init");
    Cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~NcclCommunicator() override {
    if (comm_ != nullptr) finished_ ? ncclCommAbort(comm_) : ncclCommDestroy(comm_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  std::chrono::milliseconds timeout() const override { return timeout_; }
  bool device_buffers() const override { return true; }

  void Broadcast(void* data, uint64_t bytes, int root) override {
    Run("broadcast", [&] { return ncclBroadcast(data, data, bytes, ncclUint8, root, comm_, stream_); });
  }
  std::unique_ptr<PendingSend> SendAsync(const void* data, uint64_t bytes, int peer) override {
    Run("send to rank " + std::to_string(peer), [&] { return ncclSend(data, bytes, ncclUint8, peer, comm_, stream_); });
    return std::make_unique<Done>();  // Run waited for completion: the send is done
  }
  void Recv(void* data, uint64_t bytes, int peer) override {
    Run("receive from rank " + std::to_string(peer), [&] { return ncclRecv(data, bytes, ncclUint8, peer, comm_, stream_); });
  }
  // Verdicts are host values: staged through a device buffer kept for the communicator's life (grown
  // as needed, freed by its destructor on every path). The copies are on the communicator's stream, so
  // they are ordered with the all-reduce and waited for under the same deadline.
  // Each is one of the agreement's collectives (Barrier's too): this rank goes on the store's list of those
  // that came to it first, and rank 0's failure in it names the ranks that never came (c10d_backend.cc).
  void AllReduceSum(int64_t* values, uint64_t count) override {
    const int times = ++counted_;
    channel_->ReachLater(kCollectiveStep, rank_);
    try {
      AllReduceOnDevice(values, count);
    } catch (const Error& e) {
      throw WithAbsentFromCollective(*channel_, e, size_, times, "this all-reduce");
    }
  }
  void AllReduceOnDevice(int64_t* values, uint64_t count) {
    const uint64_t bytes = count * sizeof(int64_t);
    int64_t* d = static_cast<int64_t*>(scratch_.Reserve(bytes, [&](cudaError_t rc) {
      Fail(ErrorKind::kIo, "all-reduce: cannot allocate " + std::to_string(bytes) + " bytes of device memory (cudaMalloc): " +
                               CudaText(rc));
    }));
    Cuda(cudaMemcpyAsync(d, values, bytes, cudaMemcpyHostToDevice, stream_), "all-reduce: copy to the device");
    Run("all-reduce", [&] { return ncclAllReduce(d, d, count, ncclInt64, ncclSum, comm_, stream_); });
    Cuda(cudaMemcpyAsync(values, d, bytes, cudaMemcpyDeviceToHost, stream_), "all-reduce: copy back to the host");
    Poll("all-reduce: copy back to the host");
  }
  void Barrier() override {
    int64_t one = 1;
    AllReduceSum(&one, 1);
  }
  void Abort() override {
    if (comm_ != nullptr && !finished_) ncclCommAbort(comm_);
    comm_ = nullptr;
    finished_ = true;
  }
  std::optional<FailureNote> PublishFailure(const FailureNote& mine) override { return channel_->Publish(mine); }
  std::optional<FailureNote> FetchFailure(std::chrono::milliseconds wait) override {
    channel_->ReachLater(kFailingStep, rank_);
    return channel_->Fetch(wait);
  }
  void AwaitFailureAcks(int n, std::chrono::milliseconds wait) override { channel_->AwaitAcks(n, wait); }

 private:
  struct Done : PendingSend {
    void Wait() override {}
  };

  // Device memory owned for the communicator's life: freed by the destructor, whatever threw.
  class DeviceScratch {
   public:
    DeviceScratch() = default;
    DeviceScratch(const DeviceScratch&) = delete;
    DeviceScratch& operator=(const DeviceScratch&) = delete;
    ~DeviceScratch() {
      if (ptr_ != nullptr) cudaFree(ptr_);
    }
    // At least `bytes`; on a failed cudaMalloc calls fail(rc), which must throw.
    template <typename OnFail>
    void* Reserve(uint64_t bytes, OnFail&& fail) {
      if (bytes <= bytes_) return ptr_;
      if (ptr_ != nullptr) cudaFree(ptr_);
      ptr_ = nullptr, bytes_ = 0;
      const cudaError_t rc = cudaMalloc(&ptr_, bytes);
      if (rc != cudaSuccess) {
        ptr_ = nullptr;
        cudaGetLastError();  // clear the sticky-free error state of the runtime
        fail(rc);
      }
      bytes_ = bytes;
      return ptr_;
    }

   private:
    void* ptr_ = nullptr;
    uint64_t bytes_ = 0;
  };

  static std::string CudaText(cudaError_t rc) {
    return std::string(cudaGetErrorName(rc)) + ": " + cudaGetErrorString(rc);
  }

  [[noreturn]] void Fail(ErrorKind kind, const std::string& what) {
    Abort();
    throw Error(kind, "rank " + std::to_string(rank_), "nccl " + what);
  }
  // A CUDA runtime error in a collective: the communicator is aborted (peers fail fast) and the error is
  // kComm, naming this rank, the step and CUDA's own words.
  void Cuda(cudaError_t rc, const std::string& what) {
    if (rc != cudaSuccess) {
      cudaGetLastError();
      Fail(ErrorKind::kComm, what + ": " + CudaText(rc));
    }
  }
  void Nccl(ncclResult_t rc, const std::string& what) {
    if (rc != ncclSuccess && rc != ncclInProgress) Fail(ErrorKind::kComm, what + ": " + ncclGetErrorString(rc));
  }
  // Waits for the communicator's pending work (init, or the stream's last operation).
  void Poll(const std::string& what) {
    const auto deadline = Clock::now() + timeout_;
    while (true) {
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) Fail(ErrorKind::kComm, what + ": " + ncclGetErrorString(async));
      bool idle = async == ncclSuccess && (stream_ == nullptr || cudaStreamQuery(stream_) == cudaSuccess);
      if (idle) return;
      if (Clock::now() > deadline) {
        Fail(ErrorKind::kCommTimeout, what + ": did not complete within " + std::to_string(timeout_.count()) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  template <typename F>
  void Run(const std::string& what, F&& op) {
    if (finished_) throw Error(ErrorKind::kComm, "rank " + std::to_string(rank_), "communicator is finished; " + what + " refused");
    Nccl(op(), what);
    Poll(what);
  }

  int rank_, size_;
  std::chrono::milliseconds timeout_;
  int device_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::unique_ptr<StoreChannel> channel_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool finished_ = false;
  int counted_ = 0;  // all-reduces entered (AllReduceSum)
  DeviceScratch scratch_;  // freed after the destructor ended comm_ and stream_
};

}  // namespace

std::unique_ptr<Communicator> CreateNcclCommunicator(const Rendezvous& rv, std::chrono::milliseconds timeout, int device) {
  return std::make_unique<NcclCommunicator>(rv, timeout, device);
}

}  // namespace shardcast

#else

namespace shardcast {
std::unique_ptr<Communicator> CreateNcclCommunicator(const Rendezvous&, std::chrono::milliseconds, int) {
  throw Error(ErrorKind::kUnsupported, "nccl", "unavailable in this build (built without CUDA)");
}
}  // namespace shardcast

#endif
