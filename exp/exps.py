"""Bisect experiments. EXP env selects."""
import os, sys, time
import keras
from keras import ops
import keras_dtype_policy as kdp
from keras_dtype_policy.low_precision import optimizer as lpo
sys.path.insert(0, os.path.dirname(__file__))
import repro

def comp_float32():
    orig = lpo.LowPrecisionOptimizer.add_variable
    def add_variable(self, *a, **k):
        if k.get("name", "").endswith("_compensation"):
            k["dtype"] = "float32"
        return orig(self, *a, **k)
    lpo.LowPrecisionOptimizer.add_variable = add_variable

def keep_float32(classes):
    import keras_hub
    from keras_hub.src.layers.modeling import reversible_embedding, position_embedding
    table = {"LayerNormalization": keras.layers.LayerNormalization,
             "ReversibleEmbedding": keras.layers.ReversibleEmbedding,
             "PositionEmbedding": position_embedding.PositionEmbedding,
             "Dense": keras.layers.Dense, "EinsumDense": keras.layers.EinsumDense}
    for name in classes:
        cls = table[name]
        orig = cls.__init__
        def init(self, *a, _orig=orig, **k):
            pol = k.get("dtype")
            pol = keras.dtype_policies.get(pol) if pol is not None and not isinstance(pol, keras.DTypePolicy) else pol
            if pol is None: pol = keras.config.dtype_policy()
            if pol.variable_dtype == "bfloat16":
                k["dtype"] = kdp.DTypePolicy("mixed_bfloat16")
            _orig(self, *a, **k)
        cls.__init__ = init

def main():
    exps = sys.argv[1:]
    for e in exps:
        policy, _, extra = e.partition(":")
        if "gather32" in extra:
            from keras.src.layers.core import embedding as emb_mod
            def call(self, inputs):
                if inputs.dtype != "int32" and inputs.dtype != "int64":
                    inputs = ops.cast(inputs, "int32")
                outputs = ops.take(ops.cast(self.embeddings, "float32"), inputs, axis=0)
                return ops.cast(outputs, dtype=self.compute_dtype)
            emb_mod.Embedding.call = call
        if "comp32" in extra:
            comp_float32()
        opt = None
        for part in extra.split("+"):
            if part.startswith("f32="):
                keep_float32(part[4:].split(","))
        if "state32" in extra:
            opt = kdp.LowPrecisionOptimizer(keras.optimizers.Adam(3e-3), update="kahan", state_dtype="float32")
        if "mixstate16" in extra:
            opt = kdp.LowPrecisionOptimizer(keras.optimizers.Adam(3e-3), update="stochastic_rounding", state_dtype="bfloat16")
        t = time.time()
        loss, m = repro.run(policy, opt, round_init="roundinit" in extra)
        print(f"{e:40s} {loss:.4f} {type(m.optimizer).__name__} {time.time()-t:.0f}s", flush=True)

if __name__ == '__main__':
    main()
