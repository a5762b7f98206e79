// gpu_bench's CUDA calls on the emulated device, whose headers are C++.
#include "gpu_bench_cuda.c"
