"""Gap hypothesis: autocast=False layers read unrounded float32 under mixed.

Usage: hyp.py POLICY[:opt+opt...] ...   options:
  comp32           kahan compensation in float32 (exact float32 master)
  read=MODE        how the weights of the target layers are read in the
                   forward: round (bf16-round value and gradient), fwdround
                   (value only, straight-through gradient), gradround
                   (gradient only), kahan (weight + compensation, float32)
  on=Emb,Pos,LN    target layers (default all three)
  nojit            jit_compile=False (needed for read=kahan)
  evalplain        evaluate with the read patch off
  roundinit        round float32 initial weights to bfloat16
  f32=A,B          layer classes built under mixed_bfloat16 (exps.py)
  rev=DTYPE        reverse_dtype of the token embedding (logits dtype)
"""

import contextvars
import os
import sys
import time

import keras
import numpy as np
from keras import ops
from keras.src.backend.common import variables as kvars

sys.path.insert(0, os.path.dirname(__file__))
import exps  # noqa: E402
import repro  # noqa: E402

_ACTIVE = contextvars.ContextVar("active", default=None)
_orig_autocast = kvars.Variable._maybe_autocast


def _maybe_autocast(self, value):
    value = _orig_autocast(self, value)
    act = _ACTIVE.get()
    if act is not None and id(self) in act[1]:
        value = act[0](self, value)
    return value


kvars.Variable._maybe_autocast = _maybe_autocast


def rnd(v):
    return ops.cast(ops.cast(v, "bfloat16"), "float32")


def sg(v):
    return ops.stop_gradient(v)


def make_read(mode, opt_ref):
    if mode == "round":
        return lambda var, v: rnd(v)
    if mode == "fwdround":
        return lambda var, v: v + sg(rnd(v) - v)
    if mode == "gradround":
        return lambda var, v: sg(v - rnd(v)) + rnd(v)

    def kahan(var, v):
        comp = opt_ref[0].compensation_of(var)
        c = 0.0 if comp is None else sg(ops.cast(comp._value, "float32"))
        return ops.cast(v, "float32") + c

    return kahan


def patch_layers(model, targets, reader, enabled):
    bb = model.backbone
    layers = []
    if "Emb" in targets:
        layers.append(bb.token_embedding)
    if "Pos" in targets:
        layers.append(bb.position_embedding)
    if "LN" in targets:
        layers += [
            ly
            for ly in bb._flatten_layers()
            if isinstance(ly, keras.layers.LayerNormalization)
        ]
    for ly in layers:
        ids = frozenset(id(v) for v in ly.weights)
        orig = ly.call

        def call(*a, _orig=orig, _ids=ids, **k):
            if not enabled[0]:
                return _orig(*a, **k)
            tok = _ACTIVE.set((reader, _ids))
            try:
                return _orig(*a, **k)
            finally:
                _ACTIVE.reset(tok)

        ly.call = call
    return len(layers)


def run(spec):
    policy, _, extra = spec.partition(":")
    opts = dict((p.split("=") + [True])[:2] for p in extra.split("+") if p)
    if "comp32" in opts:
        exps.comp_float32()
    if "f32" in opts and not getattr(exps, "_patched", False):
        exps.keep_float32(opts["f32"].split(","))
        exps._patched = True
    m = repro.build(policy)
    if "roundinit" in opts:
        for v in m.weights:
            if v.dtype == "float32":
                v.assign(rnd(v))
    if "rev" in opts:
        m.backbone.token_embedding.reverse_dtype = opts["rev"]
    enabled = [True]
    opt_ref = [None]
    n = 0
    if "read" in opts:
        targets = (opts.get("on") or "Emb,Pos,LN").split(",")
        n = patch_layers(m, targets, make_read(opts["read"], opt_ref), enabled)
    m.compile(
        keras.optimizers.Adam(3e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile="nojit" not in opts,
    )
    opt_ref[0] = m.optimizer
    x, y = repro.data()
    B = repro.B
    for s in range(repro.STEPS):
        m.train_on_batch(
            {k: v[B * s : B * (s + 1)] for k, v in x.items()},
            y[B * s : B * (s + 1)],
        )
    if "evalplain" in opts:
        enabled[0] = False
    xt = {k: v[:256] for k, v in x.items()}
    loss = m.evaluate(xt, y[:256], verbose=0, batch_size=256, return_dict=True)[
        "loss"
    ]
    return loss, n, m


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        t = time.time()
        loss, n, m = run(spec)
        dts = sorted({str(v.dtype) for v in m.trainable_variables})
        print(
            f"{spec:52s} {loss:.4f}  patched={n} {dts} {time.time() - t:.0f}s",
            flush=True,
        )
        del m
        np.random.seed(0)
