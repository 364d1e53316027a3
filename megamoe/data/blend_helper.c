/* Megatron-LM's greedy blending rule (megatron/core/datasets/helpers.cpp,
 * build_blending_indices), written so it can be resumed chunk by chunk.
 *
 * Position i goes to the dataset with the largest error w[d] * max(i, 1) - counts[d]
 * (strict '>', so ties go to the lowest index). The arithmetic is the reference's,
 * operation for operation, in IEEE double: compile with -ffp-contract=off so the
 * multiply and subtract are never fused into one rounding.
 *
 * Fills positions start .. start + n - 1 into dataset_index[0 .. n) and
 * sample_index[0 .. n), given counts[k] before position start; leaves counts after.
 */
#include <stdint.h>

void megamoe_blend(const double *w, int64_t k, int64_t start, int64_t n,
                   int16_t *dataset_index, int64_t *sample_index, int64_t *counts) {
    for (int64_t j = 0; j < n; ++j) {
        int64_t i = start + j;
        double t = i > 1 ? (double)i : 1.0;
        int64_t best = 0;
        double best_err = w[0] * t - (double)counts[0];
        for (int64_t d = 1; d < k; ++d) {
            double err = w[d] * t - (double)counts[d];
            int take = err > best_err; /* branch-free: picks are unpredictable */
            best = take ? d : best;
            best_err = take ? err : best_err;
        }
        dataset_index[j] = (int16_t)best;
        sample_index[j] = counts[best]++;
    }
}
