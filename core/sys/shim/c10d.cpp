// C ABI over PyTorch's c10d and the few ATen/autograd calls tch lacks: TCPStore rendezvous, ProcessGroupGloo
// backends and their asynchronous collectives. What calls libtorch_cuda (NCCL groups, streams, graphs, the CUDA
// allocator's counters) is cuda.cpp, a library of its own that ft opens only on a host with GPUs.
//
// Every entry point catches every C++ exception and returns its message as a
// malloc'd string (NULL on success) so that Rust turns it into an error instead
// of the process aborting. Tensors arrive as `at::Tensor*`, which is what tch's
// `Tensor::as_ptr()` points at.

#define USE_C10D_GLOO 1

#include "common.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <ATen/ATen.h>

#include <chrono>
#include <dlfcn.h>
#include <algorithm>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace {

enum Reduction : int { kSum = 0, kAvg = 1, kMax = 2, kMin = 3 };

using ft_shim::copy_message;
using ft_shim::guarded;

// Calls Rust through `call(message, capacity)`, which returns non-zero with
// a message on failure; that becomes an exception (an autograd node's error).
template <typename Call>
void call_rust(Call&& call) {
  char message[512] = {0};
  if (call(message, sizeof message) != 0) {
    throw std::runtime_error(message);
  }
}

c10d::ReduceOp to_reduce_op(int reduction) {
  switch (reduction) {
    case kSum:
      return c10d::ReduceOp::SUM;
    case kAvg:
      return c10d::ReduceOp::AVG;
    case kMax:
      return c10d::ReduceOp::MAX;
    case kMin:
      return c10d::ReduceOp::MIN;
  }
  throw std::invalid_argument("unknown reduction " + std::to_string(reduction));
}

}  // namespace

// Gloo has no AVG reduction: it sums, and `wait` divides afterwards.
struct FtWork {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor divide_after_wait;
  int64_t divisor = 1;
};

extern "C" {

void ft_free_error(char* error) { std::free(error); }

// Opens libtorch_cuda.so, from the directory of the libtorch_cpu.so this
// process runs (the same wheel), before libft_cuda.so that needs it. Global:
// its CUDA runtime is where ft_pin_memory_exact finds cudaHostAlloc.
char* ft_open_torch_cuda() {
  return guarded([&] {
    Dl_info info;
    TORCH_CHECK(dladdr(reinterpret_cast<void*>(&at::globalContext), &info) != 0 && info.dli_fname != nullptr,
                "cannot tell where libtorch_cpu.so was loaded from");
    std::string path(info.dli_fname);
    path = path.substr(0, path.rfind('/') + 1) + "libtorch_cuda.so";
    TORCH_CHECK(dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) != nullptr, dlerror());
  });
}

char* ft_store_create(const char* host, uint16_t port, bool is_server,
                      int64_t world_size, int64_t timeout_ms, FtStore** out) {
  return guarded([&] {
    c10d::TCPStoreOptions options;
    options.port = port;
    options.isServer = is_server;
    options.numWorkers = static_cast<size_t>(world_size);
    options.waitWorkers = true;
    options.timeout = std::chrono::milliseconds(timeout_ms);
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), options);
    *out = new FtStore{store};
  });
}

char* ft_store_prefixed(FtStore* base, const char* prefix, FtStore** out) {
  return guarded([&] {
    auto store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), base->store);
    *out = new FtStore{store};
  });
}

void ft_store_free(FtStore* store) { delete store; }

// `gloo_hostname`: the address this rank's Gloo device binds to; empty means
// Gloo's own default (GLOO_SOCKET_IFNAME, else the host name's address).
// NCCL groups are cuda.cpp's (ft_nccl_group_create).
char* ft_gloo_group_create(FtStore* store, int rank, int size, int64_t timeout_ms, const char* gloo_hostname,
                           FtGroup** out) {
  return guarded([&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> options;
    if (std::strlen(gloo_hostname) == 0) {
      options = c10d::ProcessGroupGloo::Options::create_default(timeout);
    } else {
      options = c10d::ProcessGroupGloo::Options::create(timeout);
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(gloo_hostname));
    }
    auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store->store, rank, size, options);
    *out = new FtGroup{backend, kGloo, size};
  });
}

void ft_group_free(FtGroup* group) {
  if (group == nullptr) {
    return;
  }
  // NCCL communicators must be torn down before the backend is destroyed, or
  // its watchdog reports the group as leaked. They are aborted, not shut
  // down: a group is dropped when its owner is done, ft having waited for
  // every collective it needed, or on an error; there shutdown would wait
  // for peers' collectives that never come (a rank out of memory inside an
  // expert exchange hung its job so), where abort lets the error reach the
  // user and the launcher. What PyTorch's own destructor does unless asked
  // to shut down. Errors at teardown are moot.
  try {
    if (group->kind == kNccl) {
      group->backend->abort();
    } else {
      group->backend->shutdown();
    }
  } catch (...) {
  }
  delete group;
}

char* ft_all_reduce(FtGroup* group, at::Tensor* tensor, int reduction, FtWork** out) {
  return guarded([&] {
    c10d::AllreduceOptions options;
    auto result = std::make_unique<FtWork>();
    if (reduction == kAvg && group->kind == kGloo) {
      options.reduceOp = c10d::ReduceOp::SUM;
      result->divide_after_wait = *tensor;
      result->divisor = group->size;
    } else {
      options.reduceOp = to_reduce_op(reduction);
    }
    std::vector<at::Tensor> tensors{*tensor};
    result->work = group->backend->allreduce(tensors, options);
    *out = result.release();
  });
}

char* ft_all_gather_into_tensor(FtGroup* group, at::Tensor* output, at::Tensor* input,
                                FtWork** out) {
  return guarded([&] {
    auto result = std::make_unique<FtWork>();
    result->work = group->backend->_allgather_base(*output, *input, c10d::AllgatherOptions());
    *out = result.release();
  });
}

char* ft_reduce_scatter_tensor(FtGroup* group, at::Tensor* output, at::Tensor* input,
                               int reduction, FtWork** out) {
  return guarded([&] {
    c10d::ReduceScatterOptions options;
    auto result = std::make_unique<FtWork>();
    if (reduction == kAvg && group->kind == kGloo) {
      options.reduceOp = c10d::ReduceOp::SUM;
      result->divide_after_wait = *output;
      result->divisor = group->size;
    } else {
      options.reduceOp = to_reduce_op(reduction);
    }
    result->work = group->backend->_reduce_scatter_base(*output, *input, options);
    *out = result.release();
  });
}

// Rows (the first dimension) of `input` to each member, `input_splits[i]`
// to member i, and of `output` from each; `splits` 0: equal chunks.
char* ft_all_to_all(FtGroup* group, at::Tensor* output, at::Tensor* input, const int64_t* output_splits,
                    const int64_t* input_splits, int splits, FtWork** out) {
  return guarded([&] {
    std::vector<int64_t> output_rows(output_splits, output_splits + splits);
    std::vector<int64_t> input_rows(input_splits, input_splits + splits);
    auto result = std::make_unique<FtWork>();
    result->work = group->backend->alltoall_base(*output, *input, output_rows, input_rows, c10d::AllToAllOptions());
    *out = result.release();
  });
}

char* ft_broadcast(FtGroup* group, at::Tensor* tensor, int root, FtWork** out) {
  return guarded([&] {
    c10d::BroadcastOptions options;
    options.rootRank = root;
    std::vector<at::Tensor> tensors{*tensor};
    auto result = std::make_unique<FtWork>();
    result->work = group->backend->broadcast(tensors, options);
    *out = result.release();
  });
}

char* ft_barrier(FtGroup* group, FtWork** out) {
  return guarded([&] {
    auto result = std::make_unique<FtWork>();
    result->work = group->backend->barrier(c10d::BarrierOptions());
    *out = result.release();
  });
}

// Gloo: blocks until the collective is done. NCCL: makes the caller's current
// CUDA stream wait for the collective's stream; the CPU does not block.
char* ft_work_wait(FtWork* work, int64_t timeout_ms) {
  return guarded([&] {
    // 0 means "no timeout of its own": the group's timeout still applies.
    auto timeout = std::chrono::milliseconds(timeout_ms < 0 ? 0 : timeout_ms);
    if (!work->work->wait(timeout)) {
      throw std::runtime_error("collective did not complete within " +
                               std::to_string(timeout_ms) + " ms");
    }
    if (work->divisor != 1) {
      work->divide_after_wait.div_(work->divisor);
      work->divisor = 1;
    }
  });
}

void ft_work_free(FtWork* work) { delete work; }

// A page-locked copy of a host tensor, so that a copy to the GPU can be
// asynchronous. (tch's pin_memory passes the deprecated device argument.)
char* ft_pin_memory(at::Tensor* tensor, at::Tensor** out) {
  return guarded([&] { *out = new at::Tensor(tensor->pin_memory()); });
}

// dst.copy_(src, non_blocking=true): a device-to-pinned-host copy queued on the
// current stream (tch's copy_ blocks).
char* ft_copy_async(at::Tensor* dst, at::Tensor* src) {
  return guarded([&] { dst->copy_(*src, /*non_blocking=*/true); });
}

// A pinned copy of `tensor` in exactly its bytes, for state that lives the
// whole run (offloaded masters and gradients): the caching host allocator
// behind pin_memory() rounds every block up to a power of two, so a 0.8 GB
// unit would pin 1.07 GB — tens of GB at 7B parameters. cudaHostAlloc is
// looked up in the CUDA runtime ft_open_torch_cuda loaded; without one (a
// host without GPUs) this is pin_memory().
char* ft_pin_memory_exact(at::Tensor* tensor, at::Tensor** out) {
  return guarded([&] {
    using HostAlloc = int (*)(void**, size_t, unsigned int);
    using FreeHost = int (*)(void*);
    static auto host_alloc = reinterpret_cast<HostAlloc>(dlsym(RTLD_DEFAULT, "cudaHostAlloc"));
    static auto free_host = reinterpret_cast<FreeHost>(dlsym(RTLD_DEFAULT, "cudaFreeHost"));
    auto source = tensor->contiguous();
    if (host_alloc == nullptr || free_host == nullptr) {
      *out = new at::Tensor(source.pin_memory());
      return;
    }
    void* data = nullptr;
    int status = host_alloc(&data, std::max<size_t>(source.nbytes(), 1), 0);
    TORCH_CHECK(status == 0, "cudaHostAlloc of ", source.nbytes(), " bytes failed (CUDA error ", status, "): not enough host memory to pin");
    auto pinned = at::from_blob(data, source.sizes(), [](void* p) { free_host(p); }, source.options());
    pinned.copy_(source);
    *out = new at::Tensor(pinned);
  });
}

// Sets the bytes of `tensor`'s storage: 0 frees them, a size allocates that
// many (contents undefined) from the storage's own allocator (the CUDA caching
// allocator on a GPU, so a released unit's block is reused by the next gather).
// Every tensor and view over the storage sees the change — this is how a
// sharded unit's gathered buffer is freed after use and refilled before
// backward while the autograd graph's saved views stay valid (FSDP's
// `untyped_storage().resize_`).
char* ft_resize_storage(at::Tensor* tensor, int64_t nbytes) {
  return guarded([&] {
    auto* storage = tensor->storage().unsafeGetStorageImpl();
    if (nbytes == 0) {
      storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
    } else {
      TORCH_CHECK(storage->allocator() != nullptr, "storage has no allocator to grow with");
      storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
    }
    storage->set_nbytes(static_cast<size_t>(nbytes));
  });
}

// A new tensor over `tensor`'s storage, shape and strides, without autograd
// state: writing through it (a gather refilling a unit) does not bump the
// version counter of the leaf whose views the autograd graph saved.
char* ft_storage_alias(at::Tensor* tensor, at::Tensor** out) {
  return guarded([&] {
    auto alias = at::empty({0}, tensor->options().requires_grad(false));
    alias.set_(tensor->storage(), tensor->storage_offset(), tensor->sizes(), tensor->strides());
    *out = new at::Tensor(alias);
  });
}

// Whether autograd records operations on this thread now (outside a
// no-grad scope).
bool ft_grad_enabled() { return at::GradMode::is_enabled(); }

// Starts PyTorch's Kineto profiler on this thread: host-side ATen calls, and
// CUDA kernels, copies and memsets through CUPTI when `cuda` is set.
char* ft_profiler_start(bool cuda) {
  return guarded([&] {
    using namespace torch::profiler::impl;
    ProfilerConfig config(ProfilerState::KINETO);
    std::set<ActivityType> activities{ActivityType::CPU};
    if (cuda) {
      activities.insert(ActivityType::CUDA);
    }
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
  });
}

// Stops the profiler, writes its Chrome trace to `trace_path`, and returns
// (malloc'd, in *summary) one "device\tname\tcalls\ttotal_ns" line per
// distinct event name, so callers can rank kernels without parsing the trace.
char* ft_profiler_stop(const char* trace_path, char** summary) {
  return guarded([&] {
    auto result = torch::autograd::profiler::disableProfiler();
    result->save(trace_path);
    std::map<std::pair<std::string, std::string>, std::pair<int64_t, uint64_t>> totals;
    for (const auto& event : result->events()) {
      std::string device = event.deviceType() == c10::DeviceType::CUDA ? "cuda" : "cpu";
      auto& total = totals[{device, event.name()}];
      total.first += 1;
      total.second += event.durationNs();
    }
    std::ostringstream lines;
    for (const auto& [key, total] : totals) {
      lines << key.first << '\t' << key.second << '\t' << total.first << '\t' << total.second << '\n';
    }
    *summary = copy_message(lines.str().c_str());
  });
}

// ft's own kernels (`kernels.rs`, compiled with NVRTC and launched from
// Rust) as the autograd nodes below call them: `tensors` are the op's
// operands, outputs last; non-zero means failure, with a message in
// `message`. A null kernel leaves a node on ATen's ops.
enum FusedOp : int {
  kRope = 0, kRopeTranspose = 1, kSwiGluForward = 2, kSwiGluBackward = 3, kColumnSum = 4, kLayerNormParams = 5, kRmsNormForward = 6,
  kSwiGluHalvesForward = 7, kSwiGluHalvesBackward = 8, kCombineForward = 9, kCombineBackward = 10
};
using FusedKernel = int (*)(int op, const at::Tensor* const* tensors, int count, char* message, size_t capacity);

void run_fused(int64_t kernel, FusedOp op, std::initializer_list<const at::Tensor*> tensors) {
  std::vector<const at::Tensor*> operands(tensors);
  call_rust([&](char* message, size_t capacity) {
    return reinterpret_cast<FusedKernel>(kernel)(op, operands.data(), static_cast<int>(operands.size()), message,
                                                 capacity);
  });
}

// A linear layer's bias gradient: the column sums of the [tokens, out]
// output gradient. ATen's reduction over the leading dimension reads it at
// a fraction of the bandwidth ft's two-pass kernel reaches.
at::Tensor bias_grad(int64_t kernel, const at::Tensor& grad) {
  if (kernel == 0) {
    return grad.sum(0);
  }
  at::Tensor rows = grad.contiguous();
  at::Tensor out = at::empty({rows.size(1)}, rows.options());
  run_fused(kernel, kColumnSum, {&rows, &out});
  return out;
}

// x·Wᵀ + b as one autograd node whose backward sums the bias gradient with
// ft's kernel; the GEMMs are ATen's own, as in its linear.
struct BiasLinear : public torch::autograd::Function<BiasLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, int64_t kernel) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["kernel"] = kernel;
    return at::linear(x, weight, bias);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    at::Tensor grad = grads[0].reshape({-1, weight.size(0)});
    at::Tensor grad_x, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) {
      grad_x = at::mm(grad, weight).view(x.sizes());
    }
    if (ctx->needs_input_grad(1)) {
      grad_weight = at::mm(grad.t(), x.reshape({-1, x.size(-1)}));
    }
    if (ctx->needs_input_grad(2)) {
      grad_bias = bias_grad(ctx->saved_data["kernel"].toInt(), grad);
    }
    return {grad_x, grad_weight, grad_bias, at::Tensor()};
  }
};

char* ft_bias_linear(at::Tensor* x, at::Tensor* weight, at::Tensor* bias, FusedKernel kernel, at::Tensor** out) {
  return guarded([&] { *out = new at::Tensor(BiasLinear::apply(*x, *weight, *bias, reinterpret_cast<int64_t>(kernel))); });
}

// A linear layer's GEMMs in float8 (ft-sys's float8.rs, in Rust): `step` 0
// is forward (inputs x, W; outputs x·Wᵀ and what backward reuses, the
// amaxes of x and W, or undefined), 1 backward (inputs x, W, the output's
// gradient and those amaxes; outputs the input's and the weight's
// gradients, each only where `wanted`). `code` says how operands are cast and
// scaled. Rust allocates each output and hands it over (`outputs`).
using Float8Gemms = int (*)(int step, int64_t code, const at::Tensor* const* inputs, int count, const bool* wanted,
                            at::Tensor** outputs, char* message, size_t capacity);

// Takes ownership of the tensor Rust allocated (null: none).
at::Tensor take(at::Tensor* handed) {
  if (handed == nullptr) {
    return at::Tensor();
  }
  at::Tensor tensor = std::move(*handed);
  delete handed;
  return tensor;
}

std::vector<at::Tensor> run_float8(int64_t gemms, int step, int64_t code, std::vector<const at::Tensor*> inputs,
                                   std::vector<bool> wanted) {
  std::vector<at::Tensor*> outputs(wanted.size(), nullptr);
  std::unique_ptr<bool[]> flags(new bool[wanted.size()]);
  std::copy(wanted.begin(), wanted.end(), flags.get());
  call_rust([&](char* message, size_t capacity) {
    return reinterpret_cast<Float8Gemms>(gemms)(step, code, inputs.data(),
                                                static_cast<int>(inputs.size()), flags.get(), outputs.data(), message,
                                                capacity);
  });
  std::vector<at::Tensor> taken;
  for (at::Tensor* output : outputs) {
    taken.push_back(take(output));
  }
  return taken;
}

// x·Wᵀ with the forward GEMM and both backward GEMMs in float8; x and W are
// saved in their own precision and cast again in backward, as torchao's
// Float8Linear does. With a low-rank adapter (a, b: LoRA's A and B, in the
// compute dtype), scale·(x·Aᵀ)·Bᵀ lands in the float8 GEMM's output through
// addmm's accumulate, and backward adds the adapter's input gradient into the
// base's the same way (as LoraLinear does): autograd over separate nodes pays
// one [tokens, out] add forward and one [tokens, in] add backward per layer.
struct Float8Linear : public torch::autograd::Function<Float8Linear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& a, const std::optional<at::Tensor>& b, double scale,
                            int64_t gemms, int64_t code) {
    auto out = run_float8(gemms, 0, code, {&x, &weight}, {true, true, true});
    at::Tensor product = out[0].contiguous(), down;
    if (a.has_value()) {
      down = at::mm(x.reshape({-1, x.size(-1)}), a->t());
      product.view({-1, product.size(-1)}).addmm_(down, b->t(), 1, scale);
    }
    ctx->save_for_backward({x, weight, out[1], out[2], a.value_or(at::Tensor()), b.value_or(at::Tensor()), down});
    ctx->saved_data["adapted"] = a.has_value();
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["gemms"] = gemms;
    ctx->saved_data["code"] = code;
    return product;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &grad = grads[0];
    auto out = run_float8(ctx->saved_data["gemms"].toInt(), 1, ctx->saved_data["code"].toInt(),
                          {&x, &weight, &grad, &saved[2], &saved[3]},
                          {ctx->needs_input_grad(0), ctx->needs_input_grad(1)});
    at::Tensor grad_x = out[0], grad_a, grad_b;
    // needs_input_grad counts tensor inputs only: absent adapters have no index.
    if (ctx->saved_data["adapted"].toBool()) {
      const at::Tensor &a = saved[4], &b = saved[5], &down = saved[6];
      const double scale = ctx->saved_data["scale"].toDouble();
      at::Tensor grad_rows = grad.reshape({-1, grad.size(-1)}), rows = x.reshape({-1, x.size(-1)});
      at::Tensor grad_down = at::mm(grad_rows, b).mul_(scale);
      if (grad_x.defined()) {
        grad_x = grad_x.contiguous();
        grad_x.view({-1, x.size(-1)}).addmm_(grad_down, a);
      }
      if (ctx->needs_input_grad(2)) {
        grad_a = at::mm(grad_down.t(), rows);
      }
      if (ctx->needs_input_grad(3)) {
        grad_b = at::mm(grad_rows.t(), down).mul_(scale);
      }
    }
    return {grad_x, out[1], grad_a, grad_b, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

char* ft_float8_linear(at::Tensor* x, at::Tensor* weight, at::Tensor* a, at::Tensor* b, double scale, Float8Gemms gemms,
                       int64_t code, at::Tensor** out) {
  return guarded([&] {
    std::optional<at::Tensor> maybe_a, maybe_b;
    if (a != nullptr) {
      maybe_a = *a;
      maybe_b = *b;
    }
    *out = new at::Tensor(
        Float8Linear::apply(*x, *weight, maybe_a, maybe_b, scale, reinterpret_cast<int64_t>(gemms), code));
  });
}

// LayerNorm over the last dimension with ATen's forward and input
// gradient, and its weight's and bias's gradients — column sums of
// dy·x̂ and dy — from ft's kernel in one pass over dy and x (ATen's
// gamma/beta reduction reads them at a fraction of the bandwidth).
struct LayerNorm : public torch::autograd::Function<LayerNorm> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& bias, double eps, int64_t kernel) {
    auto [out, mean, rstd] = at::native_layer_norm(x, {x.size(-1)}, weight, bias, eps);
    ctx->save_for_backward({x, weight, bias});
    ctx->saved_data["mean"] = mean;
    ctx->saved_data["rstd"] = rstd;
    ctx->saved_data["kernel"] = kernel;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &bias = saved[2];
    at::Tensor mean = ctx->saved_data["mean"].toTensor(), rstd = ctx->saved_data["rstd"].toTensor();
    at::Tensor grad = grads[0].contiguous();
    at::Tensor grad_x, grad_weight, grad_bias;
    if (ctx->needs_input_grad(0)) {
      grad_x = std::get<0>(at::native_layer_norm_backward(grad, x, {x.size(-1)}, mean, rstd, weight, bias,
                                                          {true, false, false}));
    }
    if (ctx->needs_input_grad(1) || ctx->needs_input_grad(2)) {
      // One launch writes both: the bias's gradient, then the weight's.
      const int64_t cols = x.size(-1);
      at::Tensor rows_grad = grad.view({-1, cols}), rows_x = x.contiguous().view({-1, cols});
      at::Tensor flat_mean = mean.reshape({-1}), flat_rstd = rstd.reshape({-1});
      at::Tensor sums = at::empty({2 * cols}, grad.options());
      run_fused(ctx->saved_data["kernel"].toInt(), kLayerNormParams, {&rows_grad, &rows_x, &flat_mean, &flat_rstd, &sums});
      grad_bias = sums.narrow(0, 0, cols);
      grad_weight = sums.narrow(0, cols, cols);
    }
    return {grad_x, grad_weight, grad_bias, at::Tensor(), at::Tensor()};
  }
};

char* ft_layer_norm(at::Tensor* x, at::Tensor* weight, at::Tensor* bias, double eps, FusedKernel kernel,
                    at::Tensor** out) {
  return guarded([&] {
    if (kernel == nullptr) {
      throw std::invalid_argument("LayerNorm's node needs ft's kernel");
    }
    *out = new at::Tensor(LayerNorm::apply(*x, *weight, *bias, eps, reinterpret_cast<int64_t>(kernel)));
  });
}

// RMSNorm over the last dimension: ft's kernel forward (which also writes
// the output's amax for the float8 layers reading it), ATen's fused
// backward from the rstd the forward kept.
struct RmsNorm : public torch::autograd::Function<RmsNorm> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps,
                            int64_t kernel) {
    const int64_t cols = x.size(-1);
    at::Tensor rows = x.contiguous().view({-1, cols});
    at::Tensor out = at::empty_like(rows);
    at::Tensor rstd = at::empty({rows.size(0), 1}, rows.options().dtype(at::kFloat));
    at::Tensor epsilon = at::scalar_tensor(eps, at::kDouble);
    run_fused(kernel, kRmsNormForward, {&rows, &weight, &epsilon, &out, &rstd});
    ctx->save_for_backward({x, weight});
    ctx->saved_data["rstd"] = rstd;
    return out.view(x.sizes());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &weight = saved[1];
    at::Tensor rows = saved[0].contiguous().view({-1, weight.size(0)});
    at::Tensor rstd = ctx->saved_data["rstd"].toTensor();
    const bool wants_x = ctx->needs_input_grad(0), wants_weight = ctx->needs_input_grad(1);
    if (!wants_x && !wants_weight) {
      return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    at::Tensor grad = grads[0].contiguous().view_as(rows);
    auto [grad_x, grad_weight] = at::_fused_rms_norm_backward(grad, rows, {rows.size(1)}, rstd, weight, {wants_x, wants_weight});
    if (grad_x.defined()) {
      grad_x = grad_x.view(grads[0].sizes());
    }
    return {grad_x, grad_weight, at::Tensor(), at::Tensor()};
  }
};

char* ft_rms_norm(at::Tensor* x, at::Tensor* weight, double eps, FusedKernel kernel, at::Tensor** out) {
  return guarded([&] {
    if (kernel == nullptr) {
      throw std::invalid_argument("RMSNorm's node needs ft's kernel");
    }
    *out = new at::Tensor(RmsNorm::apply(*x, *weight, eps, reinterpret_cast<int64_t>(kernel)));
  });
}

// A low-rank adapted linear layer, x·Wᵀ + b + scale·(x·Aᵀ)·Bᵀ, as one autograd
// node: the adapter's product lands in the base GEMM's output through
// addmm's accumulate (no separate add of [tokens, out] nor scale), and
// backward adds the adapter's input gradient into the base's the same way.
// Autograd over ATen's ops pays one [tokens, out] add forward and one
// [tokens, in] add backward per adapted layer.
struct LoraLinear : public torch::autograd::Function<LoraLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& a, const at::Tensor& b,
                            double scale, int64_t kernel) {
    at::Tensor rows = x.reshape({-1, x.size(-1)});
    at::Tensor out = bias.has_value() ? at::addmm(*bias, rows, weight.t()) : at::mm(rows, weight.t());
    at::Tensor down = at::mm(rows, a.t());
    out.addmm_(down, b.t(), 1, scale);
    ctx->save_for_backward({x, weight, a, b});
    ctx->saved_data["down"] = down;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["bias"] = bias.has_value();
    ctx->saved_data["kernel"] = kernel;
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    return out.view(sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &a = saved[2], &b = saved[3];
    at::Tensor down = ctx->saved_data["down"].toTensor();
    double scale = ctx->saved_data["scale"].toDouble();
    at::Tensor grad = grads[0].reshape({-1, weight.size(0)});
    at::Tensor rows = x.reshape({-1, x.size(-1)});
    at::Tensor grad_down = at::mm(grad, b).mul_(scale);
    at::Tensor grad_x, grad_weight, grad_bias, grad_a, grad_b;
    // needs_input_grad counts tensor inputs only: an absent bias has no index.
    const bool has_bias = ctx->saved_data["bias"].toBool();
    const size_t adapter = has_bias ? 3 : 2;
    if (ctx->needs_input_grad(0)) {
      grad_x = at::mm(grad, weight).addmm_(grad_down, a).view(x.sizes());
    }
    if (ctx->needs_input_grad(1)) {
      grad_weight = at::mm(grad.t(), rows);
    }
    if (has_bias && ctx->needs_input_grad(2)) {
      grad_bias = bias_grad(ctx->saved_data["kernel"].toInt(), grad);
    }
    if (ctx->needs_input_grad(adapter)) {
      grad_a = at::mm(grad_down.t(), rows);
    }
    if (ctx->needs_input_grad(adapter + 1)) {
      grad_b = at::mm(grad.t(), down).mul_(scale);
    }
    return {grad_x, grad_weight, grad_bias, grad_a, grad_b, at::Tensor(), at::Tensor()};
  }
};

char* ft_lora_linear(at::Tensor* x, at::Tensor* weight, at::Tensor* bias, at::Tensor* a, at::Tensor* b, double scale,
                     FusedKernel kernel, at::Tensor** out) {
  return guarded([&] {
    std::optional<at::Tensor> maybe_bias;
    if (bias != nullptr) {
      maybe_bias = *bias;
    }
    *out = new at::Tensor(LoraLinear::apply(*x, *weight, maybe_bias, *a, *b, scale, reinterpret_cast<int64_t>(kernel)));
  });
}

// silu(gate) * up as one autograd node that saves only its two inputs:
// ATen's silu and mul would also keep silu(gate), a third [tokens, ffn]
// activation per block, for the mul's backward. Backward recomputes it.
// With a kernel: one pass each way instead of two forward and four back.
struct SwiGlu : public torch::autograd::Function<SwiGlu> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up,
                            int64_t kernel) {
    ctx->save_for_backward({gate, up});
    ctx->saved_data["kernel"] = kernel;
    if (kernel == 0) {
      return at::silu(gate).mul_(up);
    }
    at::Tensor out = at::empty_like(gate, at::MemoryFormat::Contiguous);
    run_fused(kernel, kSwiGluForward, {&gate, &up, &out});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& gate = saved[0];
    const at::Tensor& up = saved[1];
    int64_t kernel = ctx->saved_data["kernel"].toInt();
    if (kernel == 0) {
      const at::Tensor& grad = grads[0];
      at::Tensor grad_up = at::silu(gate).mul_(grad);
      at::Tensor grad_gate = at::silu_backward(grad * up, gate);
      return {grad_gate, grad_up, at::Tensor()};
    }
    at::Tensor grad = grads[0].contiguous();
    at::Tensor grad_gate = at::empty_like(gate, at::MemoryFormat::Contiguous);
    at::Tensor grad_up = at::empty_like(up, at::MemoryFormat::Contiguous);
    run_fused(kernel, kSwiGluBackward, {&gate, &up, &grad, &grad_gate, &grad_up});
    return {grad_gate, grad_up, at::Tensor()};
  }
};

// SwiGLU over the gate and up halves of each row of x [rows, 2·width] (a
// mixture's fused gate-and-up projection) as one autograd node saving only
// x: without a kernel, silu and mul over the halves as views; with one, a
// pass each way, backward writing x's gradient whole instead of two halves
// that a concatenation would copy.
struct SwiGluHalves : public torch::autograd::Function<SwiGluHalves> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t kernel) {
    ctx->save_for_backward({x});
    ctx->saved_data["kernel"] = kernel;
    const int64_t width = x.size(1) / 2;
    if (kernel == 0) {
      return at::silu(x.narrow(1, 0, width)).mul_(x.narrow(1, width, width));
    }
    at::Tensor out = at::empty({x.size(0), width}, x.options());
    run_fused(kernel, kSwiGluHalvesForward, {&x, &out});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const int64_t width = x.size(1) / 2;
    int64_t kernel = ctx->saved_data["kernel"].toInt();
    if (kernel == 0) {
      const at::Tensor gate = x.narrow(1, 0, width), up = x.narrow(1, width, width);
      return {at::cat({at::silu_backward(grads[0] * up, gate), at::silu(gate).mul_(grads[0])}, 1), at::Tensor()};
    }
    at::Tensor grad = grads[0].contiguous();
    at::Tensor grad_x = at::empty_like(x, at::MemoryFormat::Contiguous);
    run_fused(kernel, kSwiGluHalvesBackward, {&x, &grad, &grad_x});
    return {grad_x, at::Tensor()};
  }
};

// A mixture of experts' combine as one autograd node: each token's output,
// y[t] = Σ_i w[t,i]·rows[at[t·k + i]], from the experts' output rows
// (sorted by expert), the router's fp32 weights [tokens, k] and where each
// assignment's row is (`at`); saves the three. Without a kernel, ATen's
// gather and weighted sum in fp32; with one, a pass each way, summed in
// fp32 and rounded once.
struct Combine : public torch::autograd::Function<Combine> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& rows, const at::Tensor& weights,
                            const at::Tensor& at_rows, int64_t kernel) {
    ctx->save_for_backward({rows, weights, at_rows});
    ctx->saved_data["kernel"] = kernel;
    const int64_t tokens = weights.size(0), k = weights.size(1), width = rows.size(1);
    if (kernel == 0) {
      at::Tensor gathered = rows.index_select(0, at_rows).view({tokens, k, width}).to(at::kFloat);
      return (gathered * weights.unsqueeze(-1)).sum(1).to(rows.scalar_type());
    }
    at::Tensor out = at::empty({tokens, width}, rows.options());
    run_fused(kernel, kCombineForward, {&rows, &weights, &at_rows, &out});
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &rows = saved[0], &weights = saved[1], &at_rows = saved[2];
    const int64_t tokens = weights.size(0), k = weights.size(1), width = rows.size(1);
    int64_t kernel = ctx->saved_data["kernel"].toInt();
    at::Tensor grad = grads[0].contiguous();
    if (kernel == 0) {
      at::Tensor dy = grad.to(at::kFloat).unsqueeze(1);
      at::Tensor gathered = rows.index_select(0, at_rows).view({tokens, k, width}).to(at::kFloat);
      at::Tensor grad_rows = at::empty_like(rows).index_copy_(0, at_rows, (weights.unsqueeze(-1) * dy).view({tokens * k, width}).to(rows.scalar_type()));
      return {grad_rows, (gathered * dy).sum(-1), at::Tensor(), at::Tensor()};
    }
    at::Tensor grad_rows = at::empty_like(rows, at::MemoryFormat::Contiguous);
    at::Tensor grad_weights = at::empty_like(weights, at::MemoryFormat::Contiguous);
    run_fused(kernel, kCombineBackward, {&rows, &weights, &at_rows, &grad, &grad_rows, &grad_weights});
    return {grad_rows, grad_weights, at::Tensor(), at::Tensor()};
  }
};

char* ft_swiglu_halves(at::Tensor* x, FusedKernel kernel, at::Tensor** out) {
  return guarded([&] { *out = new at::Tensor(SwiGluHalves::apply(*x, reinterpret_cast<int64_t>(kernel))); });
}

char* ft_combine(at::Tensor* rows, at::Tensor* weights, at::Tensor* at_rows, FusedKernel kernel, at::Tensor** out) {
  return guarded([&] { *out = new at::Tensor(Combine::apply(*rows, *weights, *at_rows, reinterpret_cast<int64_t>(kernel))); });
}

// An exchange of rows between ranks (expert parallelism's dispatch and
// combine) as one autograd node: Rust runs the exchange forward and its
// reverse on the gradient (`direction` 0 and 1), through the run's
// communication hook. The Rust side's state for the node lives until the
// node does: the capsule's destructor hands its handle back.
typedef int (*ExchangeFn)(int64_t handle, int direction, const at::Tensor* input, at::Tensor** output, char* message,
                          size_t capacity);
typedef void (*ReleaseFn)(int64_t handle);

struct ExchangeState : torch::CustomClassHolder {
  int64_t handle;
  ExchangeFn run;
  ReleaseFn release;
  ExchangeState(int64_t handle, ExchangeFn run, ReleaseFn release) : handle(handle), run(run), release(release) {}
  ~ExchangeState() override { release(handle); }

  at::Tensor exchange(int direction, const at::Tensor& input) const {
    char message[1024] = {0};
    at::Tensor* output = nullptr;
    if (run(handle, direction, &input, &output, message, sizeof message) != 0) {
      throw std::runtime_error(message);
    }
    at::Tensor result = std::move(*output);
    delete output;
    return result;
  }
};

struct Exchange : public torch::autograd::Function<Exchange> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input, int64_t handle, int64_t run,
                            int64_t release) {
    auto state = c10::make_intrusive<ExchangeState>(handle, reinterpret_cast<ExchangeFn>(run),
                                                    reinterpret_cast<ReleaseFn>(release));
    at::Tensor output = state->exchange(0, input);
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return output;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto state = c10::static_intrusive_pointer_cast<ExchangeState>(ctx->saved_data["state"].toCapsule());
    return {state->exchange(1, grads[0].contiguous()), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

char* ft_exchange(at::Tensor* input, int64_t handle, ExchangeFn run, ReleaseFn release, at::Tensor** out) {
  return guarded([&] {
    *out = new at::Tensor(Exchange::apply(*input, handle, reinterpret_cast<int64_t>(run), reinterpret_cast<int64_t>(release)));
  });
}

char* ft_swiglu(at::Tensor* gate, at::Tensor* up, FusedKernel kernel, at::Tensor** out) {
  return guarded([&] { *out = new at::Tensor(SwiGlu::apply(*gate, *up, reinterpret_cast<int64_t>(kernel))); });
}

// RoPE as one kernel forward and one backward (its adjoint: the same
// rotation with the sine's partner), saving only cos and sin.
struct Rope : public torch::autograd::Function<Rope> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin, int64_t kernel) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["kernel"] = kernel;
    return rotate(kernel, kRope, x, cos, sin);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    int64_t kernel = ctx->saved_data["kernel"].toInt();
    return {rotate(kernel, kRopeTranspose, grads[0], saved[0], saved[1]), at::Tensor(), at::Tensor(), at::Tensor()};
  }

  static at::Tensor rotate(int64_t kernel, FusedOp op, const at::Tensor& x, const at::Tensor& cos,
                           const at::Tensor& sin) {
    at::Tensor input = x.contiguous();
    at::Tensor out = at::empty_like(input);
    run_fused(kernel, op, {&input, &cos, &sin, &out});
    return out;
  }
};

char* ft_rope(at::Tensor* x, at::Tensor* cos, at::Tensor* sin, FusedKernel kernel, at::Tensor** out) {
  return guarded([&] {
    if (kernel == nullptr) {
      throw std::invalid_argument("RoPE's node needs ft's kernel");
    }
    *out = new at::Tensor(Rope::apply(*x, *cos, *sin, reinterpret_cast<int64_t>(kernel)));
  });
}

// Drops a tensor's .grad (Python's `p.grad = None`): the next backward then
// writes a fresh gradient instead of adding into a zeroed one.
char* ft_clear_grad(at::Tensor* tensor) {
  return guarded([&] { tensor->mutable_grad() = at::Tensor(); });
}

// torch::autograd::backward(outputs, grad_outputs): tch's run_backward
// always seeds with ones, so a unit's output cannot receive its gradient.
char* ft_backward(at::Tensor** outputs, at::Tensor** grad_outputs, int count) {
  return guarded([&] {
    std::vector<at::Tensor> outs, grads;
    for (int i = 0; i < count; ++i) {
      outs.push_back(*outputs[i]);
      grads.push_back(*grad_outputs[i]);
    }
    torch::autograd::backward(outs, grads);
  });
}

// One fused AdamW step over lists of tensors (ATen's multi-tensor kernel on
// CUDA, its vectorised loop on CPU). `steps` are float tensors the caller has
// already incremented, as torch.optim.AdamW does before the same call.
// `grad_scale` (may be NULL) divides every gradient inside the kernel: the
// global-norm clip factor and fp16's loss scale ride along instead of costing
// their own passes. A non-zero `found_inf` (may be NULL) skips the update.
char* ft_fused_adamw(at::Tensor** params, at::Tensor** grads, at::Tensor** exp_avgs,
                     at::Tensor** exp_avg_sqs, at::Tensor** steps, int count, double lr,
                     double beta1, double beta2, double weight_decay, double eps,
                     at::Tensor* grad_scale, at::Tensor* found_inf) {
  return guarded([&] {
    std::vector<at::Tensor> p, g, m, v, t;
    for (int i = 0; i < count; ++i) {
      p.push_back(*params[i]);
      g.push_back(*grads[i]);
      m.push_back(*exp_avgs[i]);
      v.push_back(*exp_avg_sqs[i]);
      t.push_back(*steps[i]);
    }
    std::optional<at::Tensor> scale, inf;
    if (grad_scale != nullptr) {
      scale = *grad_scale;
    }
    if (found_inf != nullptr) {
      inf = *found_inf;
    }
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, t, lr, beta1, beta2, weight_decay, eps,
                      /*amsgrad=*/false, /*maximize=*/false, scale, inf);
  });
}

}  // extern "C"
