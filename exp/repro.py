"""Repro: keras-hub GPT-2 (2 layers, hidden 64) under each policy."""
import os, sys, time
import numpy as np
import keras
import keras_hub
import keras_dtype_policy as kdp

V, L, B, STEPS = 64, 16, 32, 48

def data():
    # next-token task: x[t+1] = (x[t] + step) % V, step in {1,2,3}, random start.
    rng = np.random.default_rng(0)
    n = B * STEPS
    start = rng.integers(0, V, n)
    step = rng.integers(1, int(os.environ.get("STEPMAX","2")), n)
    seq = (start[:, None] + step[:, None] * np.arange(L + 1)[None]) % V
    x = {"token_ids": seq[:, :-1].astype("int32"),
         "padding_mask": np.ones((n, L), "bool")}
    return x, seq[:, 1:].astype("int32")

def build(policy):
    keras.utils.set_random_seed(int(os.environ.get("SEED", "0")))
    with kdp.policy_scope(policy):
        bb = keras_hub.models.GPT2Backbone(vocabulary_size=V, num_layers=2,
            num_heads=2, hidden_dim=64, intermediate_dim=128,
            max_sequence_length=L, dropout=0.0)
        m = keras_hub.models.GPT2CausalLM(backbone=bb, preprocessor=None)
    return m

def run(policy, optimizer=None, lr=3e-3, round_init=False):
    m = build(policy)
    if os.environ.get("REVDTYPE"):
        m.backbone.token_embedding.reverse_dtype = os.environ["REVDTYPE"]
    if round_init:
        for v in m.weights:
            if v.dtype == "float32":
                v.assign(keras.ops.cast(keras.ops.cast(v, "bfloat16"), "float32"))

    opt = optimizer or keras.optimizers.Adam(lr)
    m.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data()
    means = []
    cb = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: means.append(float(logs["loss"])))
    m.fit(x, y, batch_size=B, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    inst = [means[0]] + [(k + 1) * means[k] - k * means[k - 1] for k in range(1, len(means))]
    print("    curve", " ".join(f"{v:.2f}" for v in inst[::4]), flush=True)
    xt = {k: v[:256] for k, v in x.items()}
    r = m.evaluate(xt, y[:256], verbose=0, batch_size=256, return_dict=True)
    return r["loss"], m

if __name__ == "__main__":
    for p in sys.argv[1:] or ["float32", "mixed_bfloat16", "bfloat16", "kahan_bfloat16", "stochastic_bfloat16"]:
        t = time.time()
        loss, m = run(p)
        print(f"{p:22s} {loss:.4f}  {type(m.optimizer).__name__} {time.time()-t:.1f}s", flush=True)
