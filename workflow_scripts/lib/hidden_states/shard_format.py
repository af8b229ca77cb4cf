"""What a shard's states are, in words and a number, without torch (the merge job imports it and
starts fast): the shard format's version and the layer convention of the auxiliary ids."""

FORMAT_VERSION = 1
LAYER_CONVENTION = (
    "vllm: aux id k is the input of decoder layer k (HF hidden_states[k]); "
    "final_hidden_states is the output of the last layer before the final norm"
)
