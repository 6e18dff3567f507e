"""The product's stages: stage NAME is the module kdtree.stages.NAME (what a stage module declares:
kdtree/pipeline/registry.py)."""
