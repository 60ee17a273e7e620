"""The python-runtime code of the example pipelines (examples/pipelines.py copies each file into its
model directory, which the worker imports as a package of its own): what a user writes for a
`runtime: python` model. Each module needs numpy only (and Pillow with servewell's image transform,
for the cropper)."""
