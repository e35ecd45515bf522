// The CPU element loops built for the baseline instruction set.
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "cpu_lanes.h"

namespace swap_optimizer {
void update_params_default(DtypePair pair, const std::vector<CpuParamWork>& work,
                           const AdamHyper& hyper, const float* grad_scale) {
  DEFAULT::update_params(pair, work, hyper, grad_scale);
}
}  // namespace swap_optimizer
