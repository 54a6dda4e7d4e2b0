"""The engine kinds a profile can run (ENGINE=vllm | llamacpp): one module per kind, one table.

`kind.py` says what every layer may ask of a kind, `vllm.py` and `llamacpp.py` answer it, and
`table.py` is the table (`ENGINES`) and the lookup (`engine_kind`). Everything outside this
package asks the table; a test (tests/test_architecture.py) fails on an engine-name comparison
anywhere else, so a difference between engines is a field here, never an `== "llamacpp"` test.
"""
