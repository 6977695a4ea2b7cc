from keyroute.auth.access import ANONYMOUS, Identity, caller_of


def test_an_identity_reads_only_its_stores_and_anonymous_reads_every_store() -> None:
    team = Identity("team-a", frozenset({"fares"}))
    assert team.may_read("fares") and not team.may_read("trips")
    assert not team.admin
    assert ANONYMOUS.may_read("trips") and ANONYMOUS.admin


def test_a_call_without_an_identity_is_anonymous() -> None:
    class Bare:
        __slots__ = ()

    class WithIdentity:
        identity = Identity("svc", frozenset())

    assert caller_of(Bare()) is ANONYMOUS
    assert caller_of(WithIdentity()).name == "svc"
