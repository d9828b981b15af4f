"""Names shared by the replica host and its clients (the tensorrt_llm tensor interface).

Kept free of Triton imports so the client side can use it cheaply.
"""

MODEL_NAME = "tensorrt_llm"

# pytriton hands the callable a request's *parameters* but not its Triton
# request id, so clients send the id twice: as the Triton request id (what
# TensorRT-LLM keys `stop` on) and as this request parameter (what we key on).
REQUEST_ID_PARAM = "sluice_request_id"

# Error messages returned as Triton errors (shared with tests).
ERR_EMPTY_INPUT = "input_ids must hold at least one token"
ERR_BAD_OUTPUT_LEN = "request_output_len must be at least 1, got {}"
ERR_BAD_INPUT_LENGTHS = "input_lengths {} does not fit input_ids of {} tokens"
ERR_BATCH = "this replica takes one request per call, got {}"
ERR_MISSING = "missing required input {!r}"
ERR_BAD_TEMPERATURE = "temperature must be a finite number >= 0 (0 = greedy), got {}"
ERR_BAD_TOP_P = "runtime_top_p must be within [0, 1] (0 or 1 = no nucleus cut), got {}"
ERR_BAD_STOP_WORDS = ("stop_words_list must be [batch, 2, n]: ids, then increasing end offsets into them "
                      "padded with -1")
