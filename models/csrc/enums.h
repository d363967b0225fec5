// The integer codes the ops take, mirrored by models/ops.py's IntEnums (tests/test_kernels.py
// checks that the two sides agree).
#pragma once

#include <cstdint>

namespace cbserve {

enum Kind : int64_t { F32 = 0, Q8_0 = 1, Q4_1 = 2, Q8_0X = 3, Q4_1X = 4 };
enum Act : int64_t { NONE = 0, SILU_MUL = 1 };

}  // namespace cbserve
