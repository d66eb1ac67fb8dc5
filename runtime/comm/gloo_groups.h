// runtime/comm/gloo_groups: the Gloo groups kept from one operation to the next over the same caller's
// group, and the vote by which an operation's ranks decide together whether to use one again or make a
// new one (c10d_communicator.cc's CreateGlooCommunicatorOnStore and KeepGlooGroup are their users).
//
//   op 1 ends well on this rank   PutKept(group, {backend, token, ...})
//   op 2: TakeKept(store, ...)    AgreeOnGroup(store, token or "")  -> "reuse TOKEN" | "new TOKEN"
//                                 (or the same CommTimeout on every rank: "absent <ranks>")
//
// Thread safety: the kept groups are behind one mutex; AgreeOnGroup touches only the operation's store.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace shardcast {

// A Gloo group kept after an operation that ended well on this rank (KeepGlooGroup), for the next
// operation over the same caller's group. Its pairs are up, so that operation skips the rendezvous (the
// barrier's 2 log2(W) connections a rank, and any a send made since) and the teardown (gloo's threads joined: ~20 ms a group here). It may sit idle for
// as long as the training steps between two saves, as DCP's own Gloo group for checkpoint planning does.
struct KeptGroup {
  c10::intrusive_ptr<c10d::Backend> backend;
  std::string token;
  int rank = -1, world_size = 0;
  std::chrono::milliseconds timeout{0};
};

// The caller's group an operation's store belongs to: the store the operations' prefixes share.
const c10d::Store* GroupOf(const c10::intrusive_ptr<c10d::Store>& store);

// This rank's kept group for `store`, taken out (an operation that fails does not put it back), where it
// was made for this rank, world size and timeout (gloo's own deadline is the one it was made with).
std::optional<KeptGroup> TakeKept(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size,
                                  std::chrono::milliseconds timeout);

// Keeps `kept` for the next operation over `group` (at most a few groups are kept: past that, one goes).
void PutKept(const c10d::Store* group, KeptGroup kept);

// Drops every kept group.
void ForgetKept();

// Whether every rank still holds the kept group `mine` names, agreed over the operation's own store so
// every rank makes the same choice: "reuse TOKEN" where every rank holds it, else "new TOKEN" (a group
// every rank makes now). A rank whose last operation failed, or that joined later, holds none or another,
// so a group is reused only by exactly the ranks that made it, each in its own place.
//
// The outcome is the one value of "group/decision", whoever writes it first (compareSet): the last rank
// to arrive writes the decision; a rank that waited `timeout` for it writes "absent <ranks that never
// came>". Every rank acts on what the key holds, so a rank arriving after the timeout, or one whose wait
// timed out just as the decision came, never goes on alone: all raise the same CommTimeout, or none does.
// A store whose host is frozen never answers at all: the caller's deadline bounds that.
// `absent`: ranks this one already waited for in this operation; where none of them has come, this rank
// decides the vote at once. Throws Error kCommTimeout (not every rank came), c10::Error (the store failed).
std::string AgreeOnGroup(c10d::Store& store, const std::string& mine, int rank, int world_size,
                         std::chrono::milliseconds timeout, const std::vector<int>& absent);

// c10d's and gloo's timeouts, told by their messages (everything else is a comm failure).
bool LooksLikeTimeout(const std::string& what);

// The ranks whose addresses a timed-out store wait was for, read from c10d's message ("... keys:
// /default_pg/0//shardcast/op/0/0/1, ..."): gloo's rendezvous keys each end in the rank that sets it. Empty
// where the message names no keys, or a key that does not end in a rank of [0, world_size).
std::vector<int> RanksOfTimedOutKeys(const std::string& what, int world_size);

}  // namespace shardcast
