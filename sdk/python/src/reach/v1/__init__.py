"""The ``reach.v1`` contracts, generated from ``proto/reach/v1`` by ``scripts/generate.sh``
(buf with grpcio-tools' protoc): ``*_pb2`` messages with ``.pyi`` stubs, ``*_pb2_grpc`` stubs
and servicers. Do not edit the generated modules; change the protos and regenerate."""
