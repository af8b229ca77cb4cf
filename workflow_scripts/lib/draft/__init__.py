"""The EAGLE-3 draft: the model and its training-time-test loss (``model``), what a trained
position adds to that loss (``objectives``), greedy decoding's count of acceptance over answers
(``greedy_walk``), its building blocks (``layers``), its attention under training-time test
(``attention``) and the MLA variant (``mla``), its decoder layer stated from the verifier's config
(``layer_config``), the teacher head it learns from (``teacher_head``), the vocabulary map
(``vocab_map``), the checkpoint vLLM serves (``checkpoint``) and the same draft in the layout
SGLang and TensorRT-LLM serve (``export``)."""
