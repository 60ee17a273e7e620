"""The python-runtime code of the example pipelines (examples/pipelines.py copies each file into its
model directory, where the worker imports it as a top-level module): what a user writes for a
`runtime: python` model. Each module needs numpy only (and Pillow with servewell's image transform,
for the cropper)."""
