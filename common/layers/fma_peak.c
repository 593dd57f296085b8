// The host's float32 FMA rate, for the benches that compare a kernel with what the cores can do
// (`bench/host_peaks.py`). Each thread of the team runs 12 independent chains of vector FMAs, as many
// accumulators as a GEMM tile keeps (gemm.c), on registers alone: nothing but the FMA units bounds it.
// A matmul library's best rate (what torch.mm reaches) lies below this by its own overheads.
#include <omp.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vec __attribute__((vector_size(VW * 4)));

// GFLOP/s of `steps` rounds of 12 FMAs per thread, on `threads` threads (0: the team's default).
double fma_peak_gflops(int64_t steps, int threads) {
    double seconds = 0;
    int team = 1;
    float sink = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : omp_get_max_threads()) reduction(+ : sink)
    {
        vec a[12];
        for (int i = 0; i < 12; i++)
            for (int l = 0; l < VW; l++)
                a[i][l] = 1.0f + 0.01f * (float)(i * VW + l);  // chains the compiler cannot merge
        const vec b = (vec){0} + 0.999999f, c = (vec){0} + 1e-7f;
#pragma omp barrier
        const double t0 = omp_get_wtime();
        for (int64_t s = 0; s < steps; s++)
            for (int i = 0; i < 12; i++)
                a[i] = a[i] * b + c;  // one FMA (-ffp-contract, on in the library's build)
#pragma omp barrier
#pragma omp master
        {
            seconds = omp_get_wtime() - t0;
            team = omp_get_num_threads();  // the threads the team got, which count
        }
        for (int i = 0; i < 12; i++)
            for (int l = 0; l < VW; l++)
                sink += a[i][l];
    }
    volatile float keep = sink;  // the chains' results are used: the loop stays
    (void)keep;
    return 2.0 * VW * 12 * (double)steps * team / seconds / 1e9;
}
