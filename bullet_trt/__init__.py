"""bullet_trt: LLM serving for Triton with prefill and decode on separate SM partitions."""
__version__ = "0.1.0"


def __getattr__(name):
    # The offline API pulls in torch; import it lazily so `bullet_trt.config` stays light.
    if name in ("LLM", "SamplingParams"):
        from bullet_trt.engine import sampling
        from bullet_trt.serving import llm
        return {"LLM": llm.LLM, "SamplingParams": sampling.SamplingParams}[name]
    raise AttributeError(name)
