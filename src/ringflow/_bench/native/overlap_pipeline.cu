// overlap_pipeline.cu - ringflow's hand-written CUDA C++ baseline: the tutorial's overlap.cu,
// made measurable. Pinned host memory, the whole array copied in / computed / copied out either
// serially on one stream or chunked round-robin over N non-blocking streams; every figure is the
// median (and p10/p90) of repeated runs timed with CUDA events after warm-up (GPU span: start event
// to stop event), and each pipelined run also on the host clock, as a caller of the C++ function
// would see it (steady_clock from before the first enqueue to after the stop event's
// synchronize: the enqueue and the wake-up included), to compare with ringflow's host-timed
// calls on the same clock; the output of the
// last run of each configuration is poisoned beforehand and checked against a CPU reference on
// random data. Prints one JSON object on stdout.
//
// build: nvcc -O3 -arch=sm_90 overlap_pipeline.cu -o overlap_pipeline
// run:   ./overlap_pipeline --n 67108864 --chunks 8,16,32,64 --streams 4,1 --iters 64 --kernel seed [--refill 1]
//
// Exit codes: 0 all outputs correct, 1 a mismatch, 2 bad arguments or a CUDA error, 3 no GPU.
// On 2 and 3 stdout holds {"error": ...} (and "unavailable": true for 3).

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// ---- ringflow-kernels-begin
// The kernels every baseline launches (the Python baselines compile this block with NVRTC through
// CuPy); the same text as ringflow.benchmarks.kernels, so ringflow and the baselines compute alike.
// Launched with ceil(n / 256) blocks of 256 threads.
extern "C" __global__ void affine_iter(const float* x, float* y, int iters, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = x[i];
        for (int k = 0; k < iters; ++k) v = v * 0.999f + 0.001f;
        y[i] = v;
    }
}

extern "C" __global__ void scale_shift(const float* x, float* y, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = x[i] * 2.0f + 1.0f;
}
// ---- ringflow-kernels-end

// The JSON result is collected in memory and written at the end, so stdout holds either one
// whole result or (from fail_json) one error object.
static char* g_buf = nullptr;
static size_t g_len = 0;
static FILE* g_out = nullptr;

static void fail_json(const char* what, const char* detail, int line, int code) {
    std::printf("{\"error\": \"%s: %s (line %d)\"%s}\n", what, detail, line, code == 3 ? ", \"unavailable\": true" : "");
    std::fflush(stdout);
    std::exit(code);
}

#define CUDA_CHECK(call)                                                               \
    do {                                                                               \
        cudaError_t err_ = (call);                                                     \
        if (err_ != cudaSuccess) fail_json(#call, cudaGetErrorString(err_), __LINE__, 2); \
    } while (0)

enum class Kind { Seed, ScaleShift };

struct Config {
    size_t n = size_t(1) << 26;
    std::vector<int> chunks{8, 16, 32, 64};
    std::vector<int> streams{4, 1};
    int iters = 64;
    Kind kind = Kind::Seed;
    int repeats = 10;
    int warmup = 3;
    uint64_t seed = 12345;
    bool refill = false;  // also time each pipelined config with h_in rewritten before every repeat
};

static std::vector<int> parse_list(const char* s) {
    std::vector<int> out;
    std::string str(s);
    size_t pos = 0;
    while (pos <= str.size()) {
        size_t comma = str.find(',', pos);
        if (comma == std::string::npos) comma = str.size();
        std::string tok = str.substr(pos, comma - pos);
        if (!tok.empty()) out.push_back(std::atoi(tok.c_str()));
        pos = comma + 1;
    }
    return out;
}

static Config parse(int argc, char** argv) {
    Config c;
    for (int i = 1; i < argc; ++i) {
        std::string a = argv[i];
        if (i + 1 >= argc) fail_json("argument", ("missing value after " + a).c_str(), __LINE__, 2);
        const char* v = argv[++i];
        if (a == "--n") c.n = std::strtoull(v, nullptr, 10);
        else if (a == "--chunks") c.chunks = parse_list(v);
        else if (a == "--streams") c.streams = parse_list(v);
        else if (a == "--iters") c.iters = std::atoi(v);
        else if (a == "--repeats") c.repeats = std::atoi(v);
        else if (a == "--warmup") c.warmup = std::atoi(v);
        else if (a == "--seed") c.seed = std::strtoull(v, nullptr, 10);
        else if (a == "--refill") { c.refill = std::atoi(v) != 0; }
        else if (a == "--kernel") {
            std::string k = v;
            if (k == "seed" || k == "affine_iter") c.kind = Kind::Seed;
            else if (k == "scale_shift" || k == "axpb") c.kind = Kind::ScaleShift;
            else fail_json("argument", ("unknown kernel " + k).c_str(), __LINE__, 2);
        } else fail_json("argument", ("unknown option " + a).c_str(), __LINE__, 2);
    }
    if (c.n == 0 || c.repeats < 1 || c.warmup < 0 || c.iters < 0 || c.chunks.empty() || c.streams.empty())
        fail_json("argument", "n, repeats, chunks and streams must be positive", __LINE__, 2);
    for (int x : c.chunks) if (x < 1) fail_json("argument", "chunk counts must be >= 1", __LINE__, 2);
    for (int x : c.streams) if (x < 1) fail_json("argument", "stream counts must be >= 1", __LINE__, 2);
    return c;
}

static void launch(const Config& c, const float* src, float* dst, size_t n, cudaStream_t s) {
    if (n == 0) return;
    const unsigned block = 256;
    const size_t blocks = std::min<size_t>((n + block - 1) / block, 0x7fffffff);  // grid-stride beyond
    if (c.kind == Kind::Seed) affine_iter<<<(unsigned)blocks, block, 0, s>>>(src, dst, c.iters, n);
    else scale_shift<<<(unsigned)blocks, block, 0, s>>>(src, dst, n);
    CUDA_CHECK(cudaGetLastError());
}

struct Stats {
    double median, p10, p90, min, max;
    int runs;
};

static double percentile(const std::vector<double>& sorted, double q) {
    if (sorted.size() == 1) return sorted[0];
    double pos = q * (sorted.size() - 1);
    size_t lo = (size_t)std::floor(pos);
    size_t hi = std::min(lo + 1, sorted.size() - 1);
    return sorted[lo] + (pos - lo) * (sorted[hi] - sorted[lo]);
}

static Stats stats(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return Stats{percentile(v, 0.5), percentile(v, 0.1), percentile(v, 0.9), v.front(), v.back(), (int)v.size()};
}

static const char* jnum(double v, char* buf) {  // JSON has no inf/nan: print null
    if (!std::isfinite(v)) return "null";
    std::snprintf(buf, 32, "%.6g", v);
    return buf;
}

static void print_stats(const Stats& s) {
    std::fprintf(g_out, "\"ms_median\": %.6f, \"ms_p10\": %.6f, \"ms_p90\": %.6f, \"ms_min\": %.6f, \"ms_max\": %.6f, \"runs\": %d",
                s.median, s.p10, s.p90, s.min, s.max, s.runs);
}

// Mismatches of out against the exact function (double precision, closed form for the affine
// recurrence: v_k = a^k (v - c) + c with c = b / (1 - a), a and b the float constants).
struct Check {
    size_t mismatches;
    double max_abs_err;
};

static Check check(const Config& c, const float* in, const float* out) {
    const double a = (double)0.999f, b = (double)0.001f, fix = b / (1.0 - a);
    const double ak = std::pow(a, (double)c.iters);
    // float32 rounding of the recurrence: at most ~6e-8 per step, damped by a per step.
    const double atol = std::max(1e-5, 6e-8 * std::min(c.iters, 1000)), rtol = 1e-5;
    Check r{0, 0.0};
    for (size_t i = 0; i < c.n; ++i) {
        const double v = in[i];
        const double ref = c.kind == Kind::Seed ? ak * (v - fix) + fix : 2.0 * v + 1.0;
        const double err = std::fabs((double)out[i] - ref);
        if (!(err <= atol + rtol * std::fabs(ref))) ++r.mismatches;  // NaN (poison) counts
        if (err != err) r.max_abs_err = INFINITY;
        else if (err > r.max_abs_err) r.max_abs_err = err;
    }
    return r;
}

int main(int argc, char** argv) {
    Config c = parse(argc, argv);
    g_out = open_memstream(&g_buf, &g_len);
    if (!g_out) fail_json("open_memstream", "failed", __LINE__, 2);
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0)
        fail_json("cudaGetDeviceCount", e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device", __LINE__, 3);
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    int rt = 0, drv = 0;
    CUDA_CHECK(cudaRuntimeGetVersion(&rt));
    CUDA_CHECK(cudaDriverGetVersion(&drv));

    const size_t bytes = c.n * sizeof(float);
    float *h_in, *h_out, *d_in, *d_out, *d_scratch;
    CUDA_CHECK(cudaMallocHost(&h_in, bytes));   // pinned: the prerequisite for an asynchronous copy
    CUDA_CHECK(cudaMallocHost(&h_out, bytes));
    CUDA_CHECK(cudaMalloc(&d_in, bytes));
    const bool inplace = c.kind == Kind::Seed;   // the tutorial's kernel runs in place on the device
    if (inplace) d_out = d_in;
    else CUDA_CHECK(cudaMalloc(&d_out, bytes));
    CUDA_CHECK(cudaMalloc(&d_scratch, bytes));  // source of the D2H leg of the concurrent-copy probe

    // Random input in [-1, 1) (never zeros): xorshift64*.
    uint64_t st = c.seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < c.n; ++i) {
        st ^= st >> 12; st ^= st << 25; st ^= st >> 27;
        uint64_t r = st * 0x2545F4914F6CDD1Dull;
        h_in[i] = (float)((double)(r >> 40) / (double)(1ull << 24) * 2.0 - 1.0);
    }
    CUDA_CHECK(cudaMemcpy(d_scratch, h_in, bytes, cudaMemcpyHostToDevice));

    int max_streams = *std::max_element(c.streams.begin(), c.streams.end());
    max_streams = std::max(max_streams, 2);
    std::vector<cudaStream_t> streams(max_streams);
    for (auto& s : streams) CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::vector<cudaEvent_t> done(max_streams);
    for (auto& ev : done) CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    cudaEvent_t t0, t1;
    CUDA_CHECK(cudaEventCreate(&t0));
    CUDA_CHECK(cudaEventCreate(&t1));

    // Run `body()` warmup + repeats times, timing the repeats between events on streams[0]; the
    // other `fan` streams wait for the start event and are joined before the stop event. With
    // poison_last, h_out is filled with NaN before the last repeat, whose output is checked.
    std::vector<double> host_ms;  // the host-clock time of each repeat of the last timed() call
    // refill_before: rewrite h_in from a pageable copy before each repeat (untimed), as ringflow's
    // in-place bench must, so the DMA reads memory the CPU has just written
    std::vector<float> h_src(h_in, h_in + c.n);
    bool refill_before = false;
    auto timed = [&](int fan, auto body, bool poison_last) {
        std::vector<double> ms;
        host_ms.clear();
        for (int k = -c.warmup; k < c.repeats; ++k) {
            if (refill_before) std::memcpy(h_in, h_src.data(), bytes);
            if (poison_last && k == c.repeats - 1) std::memset(h_out, 0xFF, bytes);  // NaN everywhere
            const auto h0 = std::chrono::steady_clock::now();
            CUDA_CHECK(cudaEventRecord(t0, streams[0]));
            for (int i = 1; i < fan; ++i) CUDA_CHECK(cudaStreamWaitEvent(streams[i], t0, 0));
            body();
            for (int i = 1; i < fan; ++i) {
                CUDA_CHECK(cudaEventRecord(done[i], streams[i]));
                CUDA_CHECK(cudaStreamWaitEvent(streams[0], done[i], 0));
            }
            CUDA_CHECK(cudaEventRecord(t1, streams[0]));
            CUDA_CHECK(cudaEventSynchronize(t1));
            const auto h1 = std::chrono::steady_clock::now();
            float f = 0.f;
            CUDA_CHECK(cudaEventElapsedTime(&f, t0, t1));
            if (k >= 0) {
                ms.push_back(f);
                host_ms.push_back(std::chrono::duration<double, std::milli>(h1 - h0).count());
            }
        }
        return stats(ms);
    };

    cudaStream_t s0 = streams[0];
    // Isolated stages (whole array), and both copy directions at once.
    Stats h2d = timed(1, [&] { CUDA_CHECK(cudaMemcpyAsync(d_in, h_in, bytes, cudaMemcpyHostToDevice, s0)); }, false);
    Stats d2h = timed(1, [&] { CUDA_CHECK(cudaMemcpyAsync(h_out, d_scratch, bytes, cudaMemcpyDeviceToHost, s0)); }, false);
    Stats both = timed(2, [&] {
        CUDA_CHECK(cudaMemcpyAsync(d_in, h_in, bytes, cudaMemcpyHostToDevice, streams[0]));
        CUDA_CHECK(cudaMemcpyAsync(h_out, d_scratch, bytes, cudaMemcpyDeviceToHost, streams[1]));
    }, false);
    Stats kern = timed(1, [&] {
        // in place, the kernel would compound over repeats; time it out of place on the scratch copy
        launch(c, d_scratch, inplace ? d_in : d_out, c.n, s0);
    }, false);

    // Serial: one H2D, the kernel, one D2H, on one stream.
    Stats serial = timed(1, [&] {
        CUDA_CHECK(cudaMemcpyAsync(d_in, h_in, bytes, cudaMemcpyHostToDevice, s0));
        launch(c, d_in, d_out, c.n, s0);
        CUDA_CHECK(cudaMemcpyAsync(h_out, d_out, bytes, cudaMemcpyDeviceToHost, s0));
    }, true);
    Check serial_check = check(c, h_in, h_out);
    bool all_ok = serial_check.mismatches == 0;

    std::fprintf(g_out, "{\"program\": \"overlap_pipeline\", \"device\": \"%s\", \"cc\": \"%d.%d\", \"async_engines\": %d, "
                "\"sms\": %d, \"cuda_runtime\": %d, \"cuda_driver\": %d, ",
                prop.name, prop.major, prop.minor, prop.asyncEngineCount, prop.multiProcessorCount, rt, drv);
    std::fprintf(g_out, "\"kernel\": \"%s\", \"iters\": %d, \"inplace\": %s, \"n_floats\": %zu, \"bytes\": %zu, "
                "\"warmup\": %d, \"repeats\": %d, \"seed\": %llu, \"timing\": \"cuda_events\",\n",
                c.kind == Kind::Seed ? "affine_iter" : "scale_shift", c.kind == Kind::Seed ? c.iters : 0,
                inplace ? "true" : "false", c.n, bytes, c.warmup, c.repeats, (unsigned long long)c.seed);
    auto gbps = [&](double nbytes, const Stats& st) { return nbytes / (st.median * 1e6); };
    std::fprintf(g_out, " \"stages\": {\"h2d\": {");
    print_stats(h2d);
    std::fprintf(g_out, ", \"GBps\": %.3f}, \"d2h\": {", gbps((double)bytes, h2d));
    print_stats(d2h);
    std::fprintf(g_out, ", \"GBps\": %.3f}, \"h2d_d2h_concurrent\": {", gbps((double)bytes, d2h));
    print_stats(both);
    std::fprintf(g_out, ", \"GBps_sum\": %.3f}, \"kernel\": {", gbps(2.0 * bytes, both));
    print_stats(kern);
    std::fprintf(g_out, "}},\n");
    std::fprintf(g_out, " \"serial\": {");
    print_stats(serial);
    char buf[32];
    std::fprintf(g_out, ", \"correct\": %s, \"mismatches\": %zu, \"max_abs_err\": %s},\n \"pipelined\": [",
                serial_check.mismatches == 0 ? "true" : "false", serial_check.mismatches, jnum(serial_check.max_abs_err, buf));

    bool first = true;
    for (int ns : c.streams) {
        for (int nc : c.chunks) {
            const int fan = ns;
            auto pipelined_body = [&] {
                for (int ci = 0; ci < nc; ++ci) {
                    cudaStream_t s = streams[ci % ns];
                    const size_t lo = c.n * (size_t)ci / nc, hi = c.n * (size_t)(ci + 1) / nc, len = hi - lo;
                    if (len == 0) continue;
                    CUDA_CHECK(cudaMemcpyAsync(d_in + lo, h_in + lo, len * sizeof(float), cudaMemcpyHostToDevice, s));
                    launch(c, d_in + lo, d_out + lo, len, s);
                    CUDA_CHECK(cudaMemcpyAsync(h_out + lo, d_out + lo, len * sizeof(float), cudaMemcpyDeviceToHost, s));
                }
            };
            Stats p = timed(fan, pipelined_body, true);
            Stats host = stats(host_ms);
            Check pc = check(c, h_in, h_out);
            all_ok = all_ok && pc.mismatches == 0;
            std::fprintf(g_out, "%s\n  {\"chunks\": %d, \"streams\": %d, ", first ? "" : ",", nc, ns);
            print_stats(p);
            std::fprintf(g_out, ", \"host_clock\": {");
            print_stats(host);
            std::fprintf(g_out, "}");
            if (c.refill) {
                refill_before = true;
                Stats rp = timed(fan, pipelined_body, false);
                Stats rhost = stats(host_ms);
                refill_before = false;
                std::fprintf(g_out, ", \"refilled\": {");
                print_stats(rp);
                std::fprintf(g_out, ", \"host_clock\": {");
                print_stats(rhost);
                std::fprintf(g_out, "}}");
            }
            std::fprintf(g_out, ", \"correct\": %s, \"mismatches\": %zu, \"max_abs_err\": %s}", pc.mismatches == 0 ? "true" : "false",
                        pc.mismatches, jnum(pc.max_abs_err, buf));
            first = false;
        }
    }
    std::fprintf(g_out, "\n ],\n \"correct\": %s}\n", all_ok ? "true" : "false");

    CUDA_CHECK(cudaEventDestroy(t0));
    CUDA_CHECK(cudaEventDestroy(t1));
    for (auto& ev : done) CUDA_CHECK(cudaEventDestroy(ev));
    for (auto& s : streams) CUDA_CHECK(cudaStreamDestroy(s));
    CUDA_CHECK(cudaFreeHost(h_in));
    CUDA_CHECK(cudaFreeHost(h_out));
    CUDA_CHECK(cudaFree(d_in));
    if (!inplace) CUDA_CHECK(cudaFree(d_out));
    CUDA_CHECK(cudaFree(d_scratch));
    std::fclose(g_out);
    std::fwrite(g_buf, 1, g_len, stdout);
    std::fflush(stdout);
    std::free(g_buf);
    return all_ok ? 0 : 1;
}
