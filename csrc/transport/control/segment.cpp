#include "segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <stdexcept>
#include <thread>

namespace hca {

std::string shared_memory_identity() {
  std::ifstream boot_file("/proc/sys/kernel/random/boot_id");
  std::string boot;
  std::getline(boot_file, boot);
  std::string who = "boot " + boot;
  if (boot.empty()) {
    char name[256] = {0};
    gethostname(name, sizeof(name) - 1);
    who = std::string("host ") + name;
  }
  struct stat st {};
  const std::string shm = stat("/dev/shm", &st) == 0
                              ? std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev))
                              : "none";
  return who + ", /dev/shm " + shm;
}

namespace {

constexpr char kNamePrefix[] = "/torch_hca_";

// This process's pid namespace (its inode): pids are only comparable within
// one. Empty when it cannot be read (no /proc, a sandbox): then it is unknown,
// and matches no other, not even another unknown one.
std::string pid_namespace() {
  char link[64] = {0};
  const ssize_t n = readlink("/proc/self/ns/pid", link, sizeof(link) - 1);
  std::string text(link, n > 0 ? static_cast<size_t>(n) : 0);  // "pid:[4026531836]"
  const size_t open = text.find('['), close = text.find(']');
  return open != std::string::npos && close > open + 1 ? text.substr(open + 1, close - open - 1) : "";
}

// "/torch_hca_<pid namespace>_<creator pid>_<random>": names the creator, so
// that a segment left by one that died before every rank attached can be swept.
std::string fresh_name() {
  std::random_device rd;
  char name[96];
  const std::string pid_ns = pid_namespace();
  snprintf(name, sizeof(name), "%s%s_%d_%08x%08x", kNamePrefix, pid_ns.empty() ? "unknown" : pid_ns.c_str(),
           static_cast<int>(getpid()), rd(), rd());
  return name;
}

// Unlinks the named segments of this user whose creator, in this pid
// namespace, is gone (rank 0 died between creating one and every rank attaching).
// Not when this namespace is unknown: a pid from another one may name a live
// process there, whose segment would go.
void sweep_stale_segments() {
  const std::string pid_ns = pid_namespace();
  if (pid_ns.empty()) return;
  const std::string mine = std::string(kNamePrefix + 1) + pid_ns + "_";
  DIR* dir = opendir("/dev/shm");
  if (!dir) return;
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.rfind(mine, 0) != 0) continue;
    const int pid = std::atoi(name.c_str() + mine.size());
    struct stat st {};
    if (pid <= 0 || pid == getpid() || fstatat(dirfd(dir), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        st.st_uid != geteuid() || kill(pid, 0) == 0 || errno != ESRCH) {
      continue;
    }
    shm_unlink(("/" + name).c_str());
  }
  closedir(dir);
}

// Whoever can write the store could name any segment: only one of ours, owned
// by this user and private to it (as rank 0 creates them), is attached.
bool our_name(const std::string& name) {
  return name.rfind(kNamePrefix, 0) == 0 && name.find('/', 1) == std::string::npos;
}

void check_ours(const std::string& name, const struct stat& st, const std::string& key) {
  char mode[8];
  snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
  if (!our_name(name) || st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
    throw std::runtime_error("hca shared memory: the store names '" + name + "' as the " + key + " segment, owned by uid " +
                             std::to_string(st.st_uid) + " with mode " + mode + ": refusing it (torch_hca's segments "
                             "are named " + kNamePrefix + "*, owned by the job's user, mode 0600)");
  }
}

// The descriptors of the live segments. A forked child shares their open file
// descriptions, and with them the locks: it closes its copies right after the
// fork (and inherits no mapping, see map()), so that a parent that dies is
// seen dead while its children live on (DataLoader workers forked after init).
class OpenSegments {
 public:
  static OpenSegments& get() {
    static OpenSegments* const open = new OpenSegments();  // never destroyed: forks may come at exit
    static const bool handlers = [] {
      return pthread_atfork([] { open->mutex_.lock(); }, [] { open->mutex_.unlock(); },
                            [] { open->close_in_child(); }) == 0;
    }();
    (void)handlers;
    return *open;
  }
  void add(std::atomic<int>* fd) {
    std::lock_guard<std::mutex> lock(mutex_);
    fds_.insert(fd);
  }
  void remove(std::atomic<int>* fd) {
    std::lock_guard<std::mutex> lock(mutex_);
    fds_.erase(fd);
  }

 private:
  void close_in_child() {
    for (std::atomic<int>* fd : fds_) close(fd->exchange(-1));
    fds_.clear();
    mutex_.unlock();  // locked by the parent's prepare handler
  }
  std::mutex mutex_;
  std::set<std::atomic<int>*> fds_;
};

[[noreturn]] void fail(const std::string& what, int err) {
  throw std::runtime_error("hca shared memory: " + what + ": " + std::strerror(err));
}

// "/dev/shm: 3.2 of 64 MiB free", or nothing if it cannot be read.
std::string dev_shm_space() {
  const auto space = dev_shm_space_now();
  if (!space) return "";
  const auto mib = [](size_t bytes) {
    char text[32];
    std::snprintf(text, sizeof(text), "%.1f", static_cast<double>(bytes) / (1 << 20));
    return std::string(text);
  };
  return "/dev/shm: " + mib(space->free) + " of " + mib(space->total) + " MiB free; ";
}

char* map(int fd, size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) fail("mmap", errno);
  // Not inherited by a forked child, which may not use the group: a mapping
  // holds the open file, and with it the locks that say this process lives.
  if (madvise(p, bytes, MADV_DONTFORK) != 0) {
    const int err = errno;
    munmap(p, bytes);
    fail("madvise", err);
  }
  return static_cast<char*>(p);
}

void reserve_in(int fd, size_t offset, size_t bytes, const std::string& what) {
  const int err = bytes ? posix_fallocate(fd, static_cast<off_t>(offset), static_cast<off_t>(bytes)) : 0;
  if (err) {
    fail("reserving " + std::to_string(bytes) + " bytes in /dev/shm for " + what + "; " + dev_shm_space() +
             "if /dev/shm is too small, enlarge it, e.g. docker run --shm-size, or lower TORCH_HCA_SHM_SLOTS / "
             "TORCH_HCA_SHM_CHUNK_BYTES",
         err);
  }
}

}  // namespace

std::optional<DevShmSpace> dev_shm_space_now() {
  struct statvfs fs {};
  if (statvfs("/dev/shm", &fs) != 0) return std::nullopt;
  return DevShmSpace{static_cast<size_t>(fs.f_bavail) * fs.f_frsize, static_cast<size_t>(fs.f_blocks) * fs.f_frsize};
}

size_t product_bytes(size_t a, size_t b, size_t c, const std::string& what) {
  size_t ab = 0, abc = 0;
  if (__builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc)) {
    throw std::invalid_argument("hca: " + what + " is " + std::to_string(a) + " x " + std::to_string(b) + " x " +
                                std::to_string(c) + " bytes, more than a size_t holds");
  }
  return abc;
}

SharedSegment::SharedSegment(Rendezvous& rendezvous, const std::string& key, int rank, int world, size_t bytes,
                             const std::string& layout, std::chrono::milliseconds timeout, const std::function<void(char*)>& initialize,
                             const std::string& mismatch_hint, size_t share_bytes, size_t setup_bytes)
    : bytes_(bytes) {
  const std::string host = shared_memory_identity();
  // This rank's pages: its share, or everything for rank 0 when nothing is shared out.
  const size_t reserve_from = share_bytes ? static_cast<size_t>(rank) * share_bytes : 0;
  const size_t reserve_bytes = share_bytes ? share_bytes : (rank == 0 ? std::min(bytes, setup_bytes) : 0);
  const std::string what = "the " + key + " segment (" + layout + ")";
  auto reserve = [&](int fd) { reserve_in(fd, reserve_from, reserve_bytes, what); };
  if (rank == 0) {
    sweep_stale_segments();
    const std::string name = fresh_name();
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) fail("shm_open " + name, errno);
    try {
      if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) fail("sizing the " + key + " segment", errno);
      reserve(fd);
    } catch (...) {
      close(fd);
      shm_unlink(name.c_str());
      throw;
    }
    base_ = map(fd, bytes);
    keep(fd);
    initialize(base_);
    rendezvous.set(key, host + "\n" + name + "\n" + layout);
    // Wait for every other rank to attach, then drop the name.
    try {
      await_setup(rendezvous, [&] { return rendezvous.add(key + "_attached", 0) >= world - 1; }, timeout,
                  "hca shared memory: not every rank attached to " + name);
    } catch (...) {
      shm_unlink(name.c_str());
      release();
      throw;
    }
    shm_unlink(name.c_str());
  } else {
    await_setup(rendezvous, [&] { return rendezvous.has(key); }, timeout,
                "hca shared memory: rank 0 did not publish the " + key + " segment");
    const std::string published = rendezvous.get(key);
    const size_t cut = published.find('\n'), cut2 = published.find('\n', cut + 1);
    const std::string owner_host = published.substr(0, cut), name = published.substr(cut + 1, cut2 - cut - 1),
                      owner_layout = published.substr(cut2 + 1);
    if (owner_host != host) {
      throw std::runtime_error("hca: rank 0 runs on '" + owner_host + "' and rank " + std::to_string(rank) + " on '" +
                               host + "'; the shared-memory transport serves ranks that share one /dev/shm only");
    }
    int fd = our_name(name) ? shm_open(name.c_str(), O_RDWR | O_NOFOLLOW, 0600) : -1;
    if (fd < 0 && our_name(name)) fail("shm_open " + name, errno);
    struct stat st {};
    if (fd >= 0 && fstat(fd, &st) != 0) st = {};
    try {
      check_ours(name, st, key);
    } catch (...) {
      if (fd >= 0) close(fd);
      rendezvous.add(key + "_attached", 1);  // rank 0 must not wait for us
      throw;
    }
    const bool same = owner_layout == layout && static_cast<size_t>(st.st_size) == bytes;
    try {
      if (same) reserve(fd);
    } catch (...) {
      close(fd);
      rendezvous.add(key + "_attached", 1);
      throw;
    }
    if (same) {
      base_ = map(fd, bytes);
      keep(fd);
    } else {
      close(fd);
    }
    rendezvous.add(key + "_attached", 1);  // counted either way: rank 0 must not wait for us
    if (!same) {
      throw std::runtime_error("hca shared memory: rank 0 laid out the " + key + " segment as " + owner_layout +
                               " and rank " + std::to_string(rank) + " expects " + layout + ": " + mismatch_hint);
    }
  }
}

SharedSegment::~SharedSegment() { release(); }

void SharedSegment::keep(int fd) {
  fd_.store(fd);
  OpenSegments::get().add(&fd_);
}

void SharedSegment::release() {
  if (base_) munmap(base_, bytes_);
  base_ = nullptr;
  OpenSegments::get().remove(&fd_);
  const int fd = fd_.exchange(-1);
  if (fd >= 0) close(fd);
}

void SharedSegment::reserve(size_t offset, size_t bytes, const std::string& what) const {
  reserve_in(fd_.load(), offset, bytes, what);
}

size_t SharedSegment::reserved_bytes() const {
  struct stat st {};
  if (fstat(fd_.load(), &st) != 0) fail("fstat of a segment", errno);
  return static_cast<size_t>(st.st_blocks) * 512;  // st_blocks counts 512-byte units
}

namespace {

struct flock byte_lock(int at) {
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  lock.l_start = at;
  lock.l_len = 1;
  return lock;
}

}  // namespace

void SharedSegment::lock_byte(int at) const {
  struct flock lock = byte_lock(at);
  if (fcntl(fd_.load(), F_OFD_SETLK, &lock) != 0) fail("locking byte " + std::to_string(at) + " of a segment", errno);
}

bool SharedSegment::byte_locked_elsewhere(int at) const {
  struct flock lock = byte_lock(at);
  if (fcntl(fd_.load(), F_OFD_GETLK, &lock) != 0) return true;  // cannot tell: only the deadline applies
  return lock.l_type != F_UNLCK;
}

}  // namespace hca
