// The kernel ABI: each op's C entry point takes a pointer to one params struct, declared once as an
// X-macro list in the op's params header (templates/include/mpfa/<op>/params.cuh):
//
//   #define MPFA_DECODE_PARAMS(X) X(const void*, q) X(int64_t, q_stride_req) ...
//   struct DecodeParams { MPFA_DECODE_PARAMS(MPFA_DECLARE_FIELD) };
//   MPFA_EXPORT_PARAMS_LAYOUT(mpfa_decode_params_layout, DecodeParams, MPFA_DECODE_PARAMS)
//
// The exported function returns "<sizeof> name@offset:size ..."; mpfa_jit.abi builds the same
// text from the ctypes.Structure mirror in mpfa_jit/ops/<op>.py and refuses to call a library whose
// struct differs (a field added on one side only, reordered, or of another width).
#pragma once
#include <cstddef>
#include <string>
#include "mpfa/common.cuh"

#define MPFA_DECLARE_FIELD(type, name) type name;
#define MPFA_DESCRIBE_FIELD(type, name)                                                            \
  text += " " #name "@" + std::to_string(offsetof(Self, name)) + ":" +                             \
          std::to_string(sizeof(static_cast<Self*>(nullptr)->name));

#define MPFA_EXPORT_PARAMS_LAYOUT(symbol, S, LIST)                                  \
  MPFA_EXPORT const char* symbol() {                                                \
    static const std::string layout = [] {                                          \
      using Self = S;                                                               \
      std::string text = std::to_string(sizeof(Self));                              \
      LIST(MPFA_DESCRIBE_FIELD)                                                     \
      return text;                                                                  \
    }();                                                                            \
    return layout.c_str();                                                          \
  }
