// The CPU element loops built for the baseline instruction set.
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "cpu_lanes.h"

SWAP_OPTIMIZER_DEFINE_CPU_ENTRY(update_params_default)
