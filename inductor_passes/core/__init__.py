"""The bottom layer both packages stand on, importing only torch: the compiler's error type and
how it names a user's source line (``errors``), the per-program record of collectives
(``ledger``), the custom ops capture writes and the rules read (``ops``), and the one our
bucketing hands Inductor (``bucket_ops``: a gathered bucket's eager copy-out). ``dynamo_dist``
(the front end) and the graph passes above this import it; it imports neither."""
