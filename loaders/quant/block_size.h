// loaders/quant/block_size: the fp8 scale block, in a header of its own so that options and plans can name
// it without the kernels' header (loaders/quant/dequant.h).
#pragma once

#include <cstdint>

namespace shardcast {

struct BlockSize {
  uint64_t rows = 128;  // default 128: weight rows per scale row (bh)
  uint64_t cols = 128;  // default 128: weight columns per scale column (bw)
};

}  // namespace shardcast
