"""Feed a model on the GPU: batches made on CPU workers, normalised on the device, handed over there.

    python examples/07_feed_model.py

Each batch of images is made on the CPU (per image a crop, a flip and a brightness look-up
table: numpy work that lets go of the GIL, so the workers run side by side), crosses the link
as uint8, is normalised to float16 on the device, and reaches the model step on the device
(``deliver="device"``): nothing is copied back to the host. The consumer releases each result
once its step is enqueued; the release is stream-ordered, so the slot is reused only after the
step has read it. On a GPU the model step runs in PyTorch; RINGFLOW_DEVICE=sim forces the
simulated GPU, where it is launched on a stream of the simulated device instead.
"""

import functools
import math
import os

import numpy as np

import ringflow as rf

BATCHES, B, SIZE, PAD, HIDDEN = 32, 8, 32, 4, 16
SHAPE = (B, 3, SIZE, SIZE)
MEAN, INV_STD = 114.5, 1 / 64  # exact in float16: numpy and the GPU agree bit for bit
SOURCE = np.random.default_rng(0).integers(0, 256, (B, 3, SIZE + PAD, SIZE + PAD), dtype=np.uint8)
W = (np.random.default_rng(1).uniform(-1, 1, (3 * SIZE * SIZE, HIDDEN)) / SIZE).astype(np.float32)


def decode_augment(i):
    # runs on a CPU worker thread; the same batch for the same index
    rng = np.random.default_rng(i)
    top, left = rng.integers(0, PAD + 1, (2, B))
    lut = np.clip(np.arange(256) * rng.uniform(0.6, 1.4), 0, 255).astype(np.uint8)
    out = np.empty(SHAPE, np.uint8)
    for j in range(B):
        crop = SOURCE[j, :, top[j]:top[j] + SIZE, left[j]:left[j] + SIZE]
        out[j] = lut[crop[:, :, ::-1] if rng.random() < 0.5 else crop]
    return out


def normalise(x, y):
    # runs on the device; numpy arrays on the sim, CuPy or PyTorch on a GPU: array methods only
    y[...] = x
    y -= MEAN
    y *= INV_STD


def expected_logits(i):
    y = np.empty(SHAPE, np.float16)
    normalise(decode_augment(i), y)
    return y.reshape(B, -1).astype(np.float32) @ W


def model_on_the_sim(dev):
    """The model step launched on a stream of the simulated GPU; results released on it."""
    stream = dev.create_stream()
    logits = {}

    def keep(i, x):
        logits[i] = x.reshape(B, -1).astype(np.float32) @ W

    def step(i, res):
        stream.launch(functools.partial(keep, i), res.array, reads=[res.array])
        res.release(stream=stream)  # the slot comes back once the step has run

    def finish():
        stream.sync()
        stream.close()
        return logits

    return step, finish


def model_on_a_gpu():
    """The model step in PyTorch on its default stream, which `with res:` releases on."""
    import torch

    w = torch.from_numpy(W).cuda()
    logits = {}

    def step(i, res):
        with res:
            x = torch.as_tensor(res.array, device="cuda")  # a view, no copy
            logits[i] = x.reshape(B, -1).float() @ w

    def finish():
        return {i: t.cpu().numpy() for i, t in logits.items()}

    return step, finish


def main():
    dev = rf.device(os.environ.get("RINGFLOW_DEVICE", "auto"))
    step, finish = model_on_the_sim(dev) if dev.backend == "sim" else model_on_a_gpu()
    with rf.Pipeline(normalise, device=dev, prepare=decode_augment, chunk_bytes=2 * math.prod(SHAPE), workers=4,
                     output=(SHAPE, "float16"), deliver="device") as pipe:
        for i, res in enumerate(pipe.map(range(BATCHES))):
            step(i, res)
    logits = finish()
    wrong = [i for i in range(BATCHES) if not np.allclose(logits[i], expected_logits(i), rtol=1e-3, atol=1e-3)]
    if wrong:
        raise SystemExit(f"batches {wrong}: the model's outputs differ from numpy's")
    print(f"fed {BATCHES} batches of {B} images (3x{SIZE}x{SIZE}, float16) to the model step on the device; "
          "outputs match numpy")
    dev.close()


if __name__ == "__main__":
    main()
