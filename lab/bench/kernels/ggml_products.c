/* One token's weight products with llama.cpp's own CPU kernels, on the GGUF's own blocks.
 *
 * For every 2-D quantized weight of the file but the embedding (the products a llama.cpp token
 * runs), quantize one random activation row to the weight's vec_dot type (Q8_K for the K-quants)
 * and take ggml's vec_dot with every row of the weight, the rows split over N OpenMP threads:
 * what llama.cpp's matrix-vector products cost without its graph around them. Prints the median and
 * best of 21 tokens, and the time and bytes per block type of the last one.
 *
 *   ./run.sh MODEL.gguf [THREADS]      (builds this against build/llama.cpp, `make llama-cpp`)
 */
#include "ggml.h"
#include "ggml-cpu.h"
#include "gguf.h"
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>

#define REPS 21

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: %s MODEL.gguf [THREADS]\n", argv[0]); return 2; }
    int threads = argc > 2 ? atoi(argv[2]) : 2;
    struct ggml_context *meta = NULL;
    struct gguf_init_params params = { .no_alloc = true, .ctx = &meta };
    struct gguf_context *g = gguf_init_from_file(argv[1], params);
    if (!g) { fprintf(stderr, "%s: not a GGUF file\n", argv[1]); return 2; }
    int fd = open(argv[1], O_RDONLY);
    struct stat st;
    fstat(fd, &st);
    const char *data = (const char *)mmap(NULL, st.st_size, PROT_READ, MAP_SHARED, fd, 0) + gguf_get_data_offset(g);
    float *x = malloc(sizeof(float) * 65536), *y = malloc(sizeof(float) * 262144);
    char *xq = malloc(1 << 20);
    for (int i = 0; i < 65536; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    double took[REPS], per_type[GGML_TYPE_COUNT] = {0}, bytes[GGML_TYPE_COUNT] = {0}, total = 0;
    for (int r = 0; r < REPS; r++) {
        double t0 = now();
        for (int i = 0; i < gguf_get_n_tensors(g); i++) {
            const char *name = gguf_get_tensor_name(g, i);
            struct ggml_tensor *t = ggml_get_tensor(meta, name);
            const struct ggml_type_traits_cpu *tr = ggml_get_type_traits_cpu(t->type);
            if (ggml_n_dims(t) != 2 || !strcmp(name, "token_embd.weight") || !tr->vec_dot) continue;
            int k = t->ne[0], n = t->ne[1];
            size_t row = ggml_row_size(t->type, k);
            const char *w = data + gguf_get_tensor_offset(g, i);
            double ts = now();
            ggml_get_type_traits_cpu(tr->vec_dot_type)->from_float(x, xq, k);
            #pragma omp parallel for num_threads(threads) schedule(static)
            for (int j = 0; j < n; j++) tr->vec_dot(k, y + j, 0, w + j * row, 0, xq, 0, 1);
            if (r == REPS - 1) { per_type[t->type] += now() - ts; bytes[t->type] += (double)row * n; }
            if (r == 0) total += (double)row * n;
        }
        took[r] = now() - t0;
    }
    qsort(took, REPS, sizeof(double), by_value);
    printf("one token's products, %d threads: median %.1f ms, best %.1f ms, %.1f MB of weights "
           "(%.1f GB/s at the median)\n", threads, took[REPS / 2] * 1e3, took[0] * 1e3, total / 1e6,
           total / took[REPS / 2] / 1e9);
    for (int ty = 0; ty < GGML_TYPE_COUNT; ty++)
        if (per_type[ty] > 0)
            printf("  %s: %.1f ms, %.1f MB (last token)\n", ggml_type_name(ty), per_type[ty] * 1e3, bytes[ty] / 1e6);
    return 0;
}
