"""The engine: everything between a parsed request and a runtime, and no protocol (no HTTP, no gRPC,
no API: tests/test_layout.py keeps it so).

  encoder_service.py  EncoderService: one replica's engines and the steps of a request (the model it
                   names, its prompt, check the inputs, tokenize within the limits, queue the job,
                   wait within the deadline)
  engine.py        Engine: one served model's tokenizer, runtime, runner and batch queue
  tokenization.py  the model's tokenizer, in one batch call per request, with offsets
  batcher.py       the batch queue: a batch forms when a runner slot is free, and takes
                   everything queued up to the token budget
  runner.py        one batch: texts length-sorted into padded sub-batches, run on the runtime,
                   pooled and scattered back to their requests
  prompts.py       a model's prompts and matryoshka sizes, normalization as asked or trained
  scoring.py       what a score means: classifier logits and a cross-encoder's relevance as the
                   reference libraries read them, their order; classification with explain
  analysis.py      attention summaries (rollout, entropy) and word-level similarity
  explain.py       why a classifier scored a text as it did, word by word (occlusion, rollout)
  errors.py        why a request cannot be served (service/front/errors.py maps them to statuses, codes)
"""
