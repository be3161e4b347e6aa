// ft's calls into libtorch_cuda: NCCL groups, devices and streams, CUDA
// graphs, the caching allocator's counters. Built as a library of its own
// (libft_cuda.so, carried inside ft-sys and opened by `ft_sys::cuda`) so
// that ft itself links no CUDA library: a process on a host without GPUs
// never loads them (docs/ARCHITECTURE.md, "CUDA, opened where there are GPUs").

#define USE_C10D_NCCL 1

#include "common.h"

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/core/Event.h>
#include <ATen/cuda/CUDAGraph.h>

#include <map>
#include <mutex>

using ft_shim::guarded;

// A CUDA graph with the stream it is captured on: PyTorch captures only on
// a stream other than the default one, so capture switches the thread's
// current stream to a pool stream (`capture_stream`, ordered after the work queued so far)
// and back when it ends; replays run on the current stream again.
struct FtGraph {
  at::cuda::CUDAGraph graph;
  c10::cuda::CUDAStream previous;
  c10::cuda::CUDAStream capture;
};

// The one pool stream every capture on `device` records on. cuBLAS keeps a
// workspace for each stream it has run on (32 MiB on Hopper) as long as the
// process lives: a stream taken afresh from the pool for each capture left
// one more workspace after every rollout, up to the pool's 32 streams.
static c10::cuda::CUDAStream capture_stream(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = streams.find(device);
  if (found == streams.end()) {
    found = streams.emplace(device, c10::cuda::getStreamFromPool(false, device)).first;
  }
  return found->second;
}

extern "C" {

// What Python's init_process_group(device_id=...) does: bind the group to
// one device and connect eagerly, so that every rank does not open a
// context on GPU 0 and the first collective does not pay for set-up.
char* ft_nccl_group_create(FtStore* store, int rank, int size, int64_t timeout_ms, int device_index, FtGroup** out) {
  return guarded([&] {
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(device_index));
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = std::chrono::milliseconds(timeout_ms);
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store->store, rank, size, options);
    at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index));
    nccl->setBoundDeviceId(device);
    nccl->setSequenceNumberForGroup();
    nccl->eagerConnectSingleDevice(device);
    *out = new FtGroup{nccl, kNccl, size};
  });
}

char* ft_cuda_set_device(int device_index) {
  return guarded([&] { c10::cuda::set_device(static_cast<c10::DeviceIndex>(device_index)); });
}

// Waits on the host until `device`'s current stream has finished its queued
// work (what an offloaded step needs before reading copied-back gradients;
// unlike a device synchronisation it ignores NCCL's and other streams).
char* ft_cuda_stream_synchronize(int device) {
  return guarded([&] { c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).synchronize(); });
}

// The raw cudaStream_t of `device`'s current stream: where kernels ft
// launches itself must go to stay ordered with ATen's.
char* ft_cuda_current_stream(int device, void** out) {
  return guarded([&] { *out = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream(); });
}

// Starts recording what this thread launches on `device`; nothing runs until
// a replay. ThreadLocal mode: other threads' CUDA calls stay legal.
char* ft_graph_capture_begin(int device, FtGraph** out) {
  return guarded([&] {
    auto index = static_cast<c10::DeviceIndex>(device);
    auto previous = c10::cuda::getCurrentCUDAStream(index);
    auto capture = capture_stream(index);
    // c10's device-generic event: at::cuda::CUDAEvent would link the CUDA runtime into ft itself.
    c10::Event queued(c10::DeviceType::CUDA);
    queued.record(previous);
    queued.block(capture);
    auto* graph = new FtGraph{at::cuda::CUDAGraph(), previous, capture};
    c10::cuda::setCurrentCUDAStream(capture);
    try {
      graph->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    } catch (...) {
      c10::cuda::setCurrentCUDAStream(previous);
      delete graph;
      throw;
    }
    *out = graph;
  });
}

// Ends the recording (it fails if something in it cannot be captured, such
// as a copy to the host) and restores the thread's stream, in every case.
char* ft_graph_capture_end(FtGraph* graph) {
  return guarded([&] {
    std::exception_ptr failure;
    try {
      graph->graph.capture_end();
    } catch (...) {
      failure = std::current_exception();
    }
    c10::cuda::setCurrentCUDAStream(graph->previous);
    c10::Event captured(c10::DeviceType::CUDA);
    captured.record(graph->capture);
    captured.block(graph->previous);
    if (failure) {
      std::rethrow_exception(failure);
    }
  });
}

char* ft_graph_replay(FtGraph* graph) {
  return guarded([&] { graph->graph.replay(); });
}

void ft_graph_free(FtGraph* graph) {
  delete graph;
}

// The CUDA caching allocator's counters for `device`: bytes allocated now and
// at peak, reserved now and at peak. `reset_peak` starts a new peak window.
char* ft_cuda_memory_stats(int device, bool reset_peak, int64_t* out) {
  return guarded([&] {
    auto index = static_cast<c10::DeviceIndex>(device);
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(index);
    constexpr size_t kAggregate = 0;
    out[0] = stats.allocated_bytes[kAggregate].current;
    out[1] = stats.allocated_bytes[kAggregate].peak;
    out[2] = stats.reserved_bytes[kAggregate].current;
    out[3] = stats.reserved_bytes[kAggregate].peak;
    if (reset_peak) {
      c10::cuda::CUDACachingAllocator::resetPeakStats(index);
    }
  });
}

}  // extern "C"
