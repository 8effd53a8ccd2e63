"""Jobs on the Ray cluster beside the service: `python -m jobs embed` embeds a whole corpus with the
service's own bundle, runtimes and representations, in a Ray Data pipeline, resumably (docs/jobs.md).

    inputs.py   the input files as numbered rows: formats, row counts, the rows of a range
    shards.py   the output directory: shards written whole, the record of done rows, resumption
    embed.py    the job: its spec, the actor that holds one engine, the pipeline, the summary
    batch.py    the job as a detached, named Ray actor per batch of the service's Batch API
"""
