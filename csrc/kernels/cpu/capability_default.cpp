// The CPU element loops built for the baseline instruction set.
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "cpu_lanes.h"
#include "compact_lanes.h"

SWAP_OPTIMIZER_DEFINE_CPU_ENTRY(update_params_default)
SWAP_OPTIMIZER_DEFINE_COMPACT_ENTRY(update_compact_rows_default)
SWAP_OPTIMIZER_DEFINE_CODEC_LOOPS(codec_loops_default)
