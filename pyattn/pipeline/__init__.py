"""The op pipeline every public op runs through: read the arguments (``pyattn.interop``), validate
them into a frozen problem (``pyattn.validate``), plan once per problem (:mod:`.plans`), run on the
device (:mod:`.device`), and return device arrays or, for NumPy inputs, NumPy results through the
pinned, pipelined host path (:mod:`.host`, :mod:`.chunks`)."""
