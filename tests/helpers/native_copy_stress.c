/* A stress driver for the native copy (ringflow/_device/native_copy.py's C source, compiled
   with it): three threads each make `rounds` copies of random lengths (every other one short),
   misalignments and thread counts, checking every byte and the bytes around the destination,
   while the helpers' polling time changes under them. Built with -fsanitize=thread it also
   reports any access to shared state that nothing orders.
   Usage: native_copy_stress ROUNDS; exit status 0 and "ok ..." when every copy was right. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

int ringflow_copy(char *dst, const char *src, size_t n, int threads);
void ringflow_copy_spin(long ns);
void ringflow_copy_counters(long *out);

static int rounds = 500;

static void *copier(void *arg) {
    unsigned seed = (unsigned)(long)arg;
    size_t most = 3u << 20;
    char *src = malloc(most), *dst = malloc(most + 128);
    if (!src || !dst) { printf("no memory\n"); exit(2); }
    for (int k = 0; k < rounds; k++) {
        /* every other copy a short one of a few parts */
        size_t n = k % 2 ? (size_t)rand_r(&seed) % most : (32u << 10) + (size_t)rand_r(&seed) % (224u << 10);
        int threads = 1 + rand_r(&seed) % 9;
        size_t off = (size_t)rand_r(&seed) % 64;
        for (size_t i = 0; i < n; i += 512) src[i] = (char)(1 + rand_r(&seed) % 255);
        memset(dst, 0, n + 128);
        ringflow_copy(dst + off, src, n, threads);
        if (memcmp(dst + off, src, n) != 0) { printf("wrong bytes: n=%zu threads=%d\n", n, threads); exit(1); }
        for (size_t i = 0; i < off; i++)
            if (dst[i]) { printf("wrote before the destination: n=%zu\n", n); exit(1); }
        for (size_t i = off + n; i < n + 128; i++)
            if (dst[i]) { printf("wrote past the destination: n=%zu\n", n); exit(1); }
        if (k % 100 == 0) ringflow_copy_spin((rand_r(&seed) % 3) * 50000L);
    }
    free(src);
    free(dst);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1) rounds = atoi(argv[1]);
    pthread_t c[3];
    for (long i = 0; i < 3; i++) pthread_create(&c[i], NULL, copier, (void *)(i + 1));
    for (int i = 0; i < 3; i++) pthread_join(c[i], NULL);
    long out[4];
    ringflow_copy_counters(out);
    printf("ok split=%ld helper_parts=%ld sleeping_called=%ld wait_ns=%ld\n", out[0], out[1], out[2], out[3]);
    return 0;
}
