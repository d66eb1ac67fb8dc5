// loaders/mxfp4.h moved to loaders/quant/mxfp4.h with the other quantized-format kernels (issue 32). This
// forwarder keeps every include of the old path working (the moved kernels' own, unchanged by the
// move, among them) until each names the new one.
#pragma once

#include "loaders/quant/mxfp4.h"
