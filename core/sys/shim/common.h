// What the shim's two halves share: c10d.cpp (linked into ft) and cuda.cpp
// (libft_cuda.so, opened on hosts with GPUs) hand stores and groups to each
// other, and both report C++ exceptions the same way.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>

enum BackendKind : int { kGloo = 0, kNccl = 1 };

struct FtStore {
  c10::intrusive_ptr<c10d::Store> store;
};

struct FtGroup {
  c10::intrusive_ptr<c10d::Backend> backend;
  int kind;
  int size;
};

namespace ft_shim {

inline char* copy_message(const char* message) {
  size_t length = std::strlen(message);
  char* copy = static_cast<char*>(std::malloc(length + 1));
  if (copy != nullptr) {
    std::memcpy(copy, message, length + 1);
  }
  return copy;
}

// Runs `body`; returns NULL or the exception's message. c10::Error carries a
// C++ backtrace in what(); the short form is what a user needs to read.
template <typename Body>
char* guarded(Body&& body) {
  try {
    body();
    return nullptr;
  } catch (const c10::Error& error) {
    return copy_message(error.what_without_backtrace());
  } catch (const std::exception& error) {
    return copy_message(error.what());
  } catch (...) {
    return copy_message("unknown C++ exception");
  }
}

}  // namespace ft_shim
