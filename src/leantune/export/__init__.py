"""Export a trained model to the formats people deploy, each checked for parity with its source.

`leantune.export.run.export_model` is the entry point; `FORMATS` there maps a format name to its
writer and loader.
"""
