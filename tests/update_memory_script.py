"""Test helper: one Learner update in this fresh process, printing its peak memory as JSON.

    python update_memory_script.py MODEL_DIR CHECKPOINTING(0|1)

A thread samples the process's resident anonymous memory (RssAnon) every 2 ms while
`Learner.update` runs; the printed peak is above its value just before the update, so the
weights and AdamW moments (allocated at construction) are not in it. The mini-batch: two
prompts of 8 tokens, K=4 completions of 248 tokens each (one padded forward of 8 x 256).
"""

import json
import sys
import threading
import time


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    import torch

    from workers.roles.learner import Learner

    model, checkpointing = sys.argv[1], sys.argv[2] == "1"
    torch.manual_seed(0)
    learner = Learner(0, model, learning_rate=1e-3, train_batch_size=2, device="cpu",
                      threads=1, gradient_checkpointing=checkpointing)
    g = torch.Generator().manual_seed(1)
    groups = [{"prompt_ids": torch.randint(0, 500, (8,), generator=g).tolist(),
               "completions": [torch.randint(0, 500, (248,), generator=g).tolist()
                               for _ in range(4)],
               "returns": [0.1, 0.7, 0.3, 0.9], "turn": 0} for _ in range(2)]
    base = rss_anon()
    peak, done = [base], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.002)

    thread = threading.Thread(target=sample)
    thread.start()
    out = learner.update(groups, shuffle_seed=0)
    done.set()
    thread.join()
    weights = {k: v.sum().item() for k, v in learner.model.state_dict().items()}
    print(json.dumps({"peak_bytes": peak[0] - base, "loss": out["loss"], "tokens": 8 * 256,
                      "weights": weights}))


if __name__ == "__main__":
    main()
