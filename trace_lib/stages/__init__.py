"""One module per dvc stage, each with `run_<stage>(params, root)`: the I/O edges of the pipeline.

A stage module may import any package of trace_lib but never another stage; no package imports a stage.
The notebooks in `notebooks/` call these functions; `trace_lib.paths.STAGES` lists them in order."""
