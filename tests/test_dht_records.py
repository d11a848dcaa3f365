"""Record rules and wire parsing, without a network: signatures, limits, schemas, malformed input."""

from __future__ import annotations

import msgpack
import pytest
from pydantic import BaseModel

from potluck.core.serialization import dumps
from potluck.dht import protocol
from potluck.dht.errors import BadRequest, ExpirationTooFar, NotOwner, RecordRejected, ValueTooLarge
from potluck.dht.records import Record, key_id_of, owner_marker, owners_of
from potluck.dht.routing import node_id_of
from potluck.dht.validation import (
    CLOCK_SKEW_ALLOWANCE,
    Limits,
    SchemaValidator,
    VerifiedSignatures,
    check_record,
    sign_record,
)
from potluck.net.address import Multiaddr
from potluck.net.identity import Identity

NOW = 1_000_000.0
LIMITS = Limits()


def owned_record(identity: Identity, value=1, exp=NOW + 60, subkey=None) -> Record:
    key = f"progress{owner_marker(identity.peer_id)}"
    return sign_record(Record(key, subkey, dumps(value), exp), identity)


@pytest.mark.timeout(10)
def test_owner_signed_records_verify_and_every_tampering_is_refused():
    alice, mallory = Identity.generate(), Identity.generate()
    good = owned_record(alice)
    assert check_record(good, LIMITS, NOW) == 1
    assert owners_of(good.key, None) == alice.peer_id
    tampered = [
        Record(good.key, None, dumps(2), good.expiration_time, good.signature),  # other value
        Record(good.key, None, good.value, good.expiration_time + 1, good.signature),  # later expiry
        Record(good.key, "sub", good.value, good.expiration_time, good.signature),  # other subkey
        Record(good.key, None, good.value, good.expiration_time, bytes(64)),  # forged signature
        Record(good.key, None, good.value, good.expiration_time,  # signed by someone else
               mallory.sign(Record(good.key, None, good.value, good.expiration_time).signed_bytes())),
        Record(good.key, None, good.value, good.expiration_time),  # no signature at all
    ]
    for record in tampered:
        with pytest.raises(NotOwner, match=str(alice.peer_id)):
            check_record(record, LIMITS, NOW)


@pytest.mark.timeout(10)
def test_a_remembered_signature_vouches_only_for_its_own_record():
    """Records are checked once per process; a tampered copy of a checked record is still refused."""
    alice, mallory = Identity.generate(), Identity.generate()
    good = owned_record(alice, value="checked once")
    for _ in range(2):  # the second time from the cache
        assert check_record(good, LIMITS, NOW) == "checked once"
    for tampered in (
        Record(good.key, None, dumps("changed"), good.expiration_time, good.signature),
        Record(good.key, None, good.value, good.expiration_time + 1, good.signature),
        Record(good.key, None, good.value, good.expiration_time, good.signature, b"a token it never signed"),
        Record(good.key, None, good.value, good.expiration_time, mallory.sign(good.signed_bytes())),
        Record(good.key, "a subkey", good.value, good.expiration_time, good.signature),
    ):
        for _ in range(2):
            with pytest.raises(NotOwner):
                check_record(tampered, LIMITS, NOW)


@pytest.mark.timeout(10)
def test_verified_signatures_remember_successes_only_and_stay_bounded():
    alice = Identity.generate()
    cache = VerifiedSignatures(max_entries=3)
    signed = [(b"data %d" % i, alice.sign(b"data %d" % i)) for i in range(5)]
    assert not cache.verify(alice.peer_id, signed[0][1], b"other data")
    assert not cache.verify(alice.peer_id, signed[0][1][:-1] + bytes([signed[0][1][-1] ^ 1]), signed[0][0])
    assert not cache.verify(alice.peer_id, signed[0][1] + b"d", b"ata 0")  # not a shifted boundary either
    assert len(cache) == 0
    for data, signature in signed:
        assert cache.verify(alice.peer_id, signature, data)
        assert cache.verify(alice.peer_id, signature, data)
    assert len(cache) == 3
    assert not cache.verify(Identity.generate().peer_id, signed[-1][1], signed[-1][0])  # another signer


@pytest.mark.timeout(10)
def test_only_the_owner_can_sign_and_owner_markers_must_be_well_formed():
    alice, bob = Identity.generate(), Identity.generate()
    with pytest.raises(NotOwner, match="only that peer can store it"):
        sign_record(Record(f"x{owner_marker(alice.peer_id)}", None, dumps(1), NOW), bob)
    # an owner in the subkey works the same way (e.g. one entry per peer in a group dictionary)
    entry = sign_record(Record("group.7", owner_marker(bob.peer_id), dumps("addr"), NOW + 5), bob)
    assert entry.signature is not None and check_record(entry, LIMITS, NOW) == "addr"
    with pytest.raises(NotOwner, match="different owners"):
        owners_of(f"k{owner_marker(alice.peer_id)}", owner_marker(bob.peer_id))
    with pytest.raises(NotOwner, match="malformed"):
        owners_of("k[owner:not base58!]", None)
    with pytest.raises(NotOwner, match="not hold a valid peer id"):
        owners_of("k[owner:abc]", None)
    with pytest.raises(RecordRejected, match="only records whose key"):
        check_record(Record("plain", None, dumps(1), NOW + 1, bytes(64)), LIMITS, NOW)


@pytest.mark.timeout(10)
def test_limits_refuse_oversized_values_far_expirations_and_undecodable_bytes():
    big = Record("k", None, dumps(b"x" * (64 * 1024)), NOW + 1)
    with pytest.raises(ValueTooLarge, match="65536 bytes"):
        check_record(big, LIMITS, NOW)
    assert check_record(big, Limits(max_value_bytes=70_000), NOW) == b"x" * 65536
    far = Record("k", None, dumps(1), NOW + LIMITS.max_ttl + 1)
    with pytest.raises(ExpirationTooFar, match="at most 86400 s"):
        check_record(far, LIMITS, NOW, skew=0.0)
    check_record(far, LIMITS, NOW, skew=CLOCK_SKEW_ALLOWANCE)  # nodes allow for clock skew
    with pytest.raises(ExpirationTooFar):
        check_record(Record("k", None, dumps(1), NOW + 10 * 86400), LIMITS, NOW, skew=CLOCK_SKEW_ALLOWANCE)
    with pytest.raises(RecordRejected, match="not potluck-serialized"):
        check_record(Record("k", None, b"\x00garbage", NOW + 1), LIMITS, NOW)


class ExpertInfo(BaseModel):
    host: str
    port: int


@pytest.mark.timeout(10)
def test_schema_validator_checks_values_under_its_prefix_only():
    schemas = [SchemaValidator({"expert.": ExpertInfo})]
    ok = Record("expert.ffn.3", None, dumps({"host": "a", "port": 1}), NOW + 1)
    assert check_record(ok, LIMITS, NOW, schemas) == {"host": "a", "port": 1}
    with pytest.raises(RecordRejected, match="ExpertInfo.*port"):
        check_record(Record("expert.ffn.3", None, dumps({"host": "a"}), NOW + 1), LIMITS, NOW, schemas)
    check_record(Record("other", None, dumps([1, 2]), NOW + 1), LIMITS, NOW, schemas)
    with pytest.raises(TypeError):
        SchemaValidator({"x": dict})


@pytest.mark.timeout(10)
def test_key_ids_distinguish_str_and_bytes_and_are_stable():
    assert key_id_of("a") != key_id_of(b"a")
    assert key_id_of("a") == key_id_of("a") and 0 <= key_id_of("a") < 2**160


@pytest.mark.timeout(10)
def test_malformed_messages_are_refused_with_bad_request():
    garbage = [None, 5, "text", b"\xc1", b"\x92\x01", protocol.encode([1, 2]), protocol.encode({"ids": "x"}),
               protocol.encode({"ids": [b"short"], "values": True}),
               protocol.encode({"ids": [bytes(20)] * 33, "values": True}),
               protocol.encode({"ids": [bytes(20)], "values": 1}),
               protocol.encode({"ids": [bytes(20)], "values": True, "stop": False, "rec": ["k"]})]
    for message in garbage:
        with pytest.raises(BadRequest):
            protocol.read(protocol.FindRequest, message)
    for request in (protocol.FindRequest((1, 2), True, True),
                    protocol.FindRequest((1,), False, False, own_record=Record("k", None, b"v", 1.0))):
        assert protocol.read(protocol.FindRequest, protocol.write(request)) == request
    bad_records = [[], ["k"], [1, None, b"v", 1.0, None, None], ["k", True, b"v", 1.0, None, None],
                   ["k", None, "not bytes", 1.0, None, None], ["k", None, b"v", "soon", None, None],
                   ["k", None, b"v", float("inf"), None, None], ["k", None, b"v", 1.0, b"short sig", None],
                   ["k" * 2000, None, b"v", 1.0, None, None], ["k", None, b"v", 1.0, None, 5],
                   ["k", 2**63, b"v", 1.0, None, None]]
    for item in bad_records:
        with pytest.raises(BadRequest):
            protocol.read(protocol.StoreRequest, protocol.encode({"records": [item]}))
    with pytest.raises(BadRequest, match="at most 256"):
        protocol.read(protocol.StoreRequest, protocol.encode({"records": [["k", None, b"v", 1.0, None, None]] * 257}))
    with pytest.raises(BadRequest):
        protocol.read(protocol.Ping, protocol.encode({"x": 1}))
    protocol.read(protocol.Ping, protocol.PING_REQUEST)
    for outcomes in ([True, "no", 3], [True]):  # one outcome per record sent, each True, False or a reason
        with pytest.raises(BadRequest):
            protocol.read(protocol.StoreResponse, protocol.encode({"results": outcomes}), n_records=3)


@pytest.mark.timeout(10)
def test_malformed_answers_are_refused_so_the_caller_can_drop_that_peer():
    pid = Identity.generate().peer_id.to_bytes()
    answers = [
        {"peers": [], "results": []},  # wrong number of results
        {"peers": [[pid, []]], "results": [[[1], []]]},  # index out of range
        {"peers": [[b"x", []]], "results": [[[0], []]]},  # bad peer id
        {"peers": [[pid, ["/nonsense"]]], "results": [[[0], []]]},  # bad address
        {"peers": [[pid, [7]]], "results": [[[0], []]]},  # address of the wrong type
        {"peers": [], "results": [[[], [["k"]]]]},  # bad record
        {"peers": [], "results": [[[], []]], "rec": 5},  # "did you hold my record" answered with a number
    ]
    for answer in answers:
        with pytest.raises(BadRequest):
            protocol.read(protocol.FindResponse, msgpack.packb(answer), n_ids=1)
    ok = protocol.read(protocol.FindResponse, msgpack.packb({"peers": [[pid, ["/emu/1"]]], "results": [[[0], []]]}),
                       n_ids=1)
    assert ok.peers[ok.results[0].nearest[0]][0].to_bytes() == pid and ok.held is None


@pytest.mark.timeout(10)
def test_dht_messages_keep_their_compact_wire_form():
    """Keys, positional lists and ids as 20 bytes: what a node sends is what it sent before the
    messages were declared, byte for byte."""
    pid = Identity.generate().peer_id
    record = Record("k", None, b"v", 1.0)
    key = (5).to_bytes(20, "big")
    assert protocol.write(protocol.FindRequest((5,), True, False)) == protocol.encode(
        {"ids": [key], "values": True, "stop": False})
    assert protocol.write(protocol.FindRequest((5,), False, True, record)) == protocol.encode(
        {"ids": [key], "values": False, "stop": True, "rec": record.to_wire()})
    near = (pid, node_id_of(pid), (Multiaddr.parse("/emu/1"),))
    answer = protocol.FindResponse((near,), (protocol.FindResult((0,), (record,)),), "RecordRejected: no")
    assert protocol.write(answer) == protocol.encode(
        {"peers": [[pid.to_bytes(), ["/emu/1"]]], "results": [[[0], [record.to_wire()]]], "rec": "RecordRejected: no"})
    assert protocol.read(protocol.FindResponse, protocol.write(answer), n_ids=1) == answer
    assert protocol.write(protocol.StoreRequest((record,))) == protocol.encode({"records": [record.to_wire()]})
    assert protocol.write(protocol.StoreResponse((True, "no"))) == protocol.encode({"results": [True, "no"]})
    assert protocol.PING_REQUEST == protocol.encode({}) and protocol.PING_RESPONSE == protocol.encode({"ok": True})
