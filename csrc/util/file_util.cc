#include "util/file_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

namespace flash_reasoning {

namespace {

// What a file that is not a regular file is, for errors.
const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

Status io_error(const std::string& path, const char* what, const std::string& problem) {
  return Status::Error(Code::kIoError, std::string(what) + " " + path + " " + problem);
}

// Reads exactly `size` bytes of `fd` into `out`, which is left alone on failure.
Status read_exactly(int fd, size_t size, const std::string& path, const char* what, std::string* out) {
  std::string bytes;
  try {
    bytes.resize(size);
  } catch (const std::bad_alloc&) {
    return Status::Error(Code::kOutOfMemory, std::string(what) + " " + path + " is " + std::to_string(size) +
                                                 " bytes: host memory exhausted reading it");
  }
  size_t done = 0;
  while (done < size) {
    ssize_t n = ::read(fd, &bytes[done], size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return io_error(path, what, std::string("cannot be read: ") + std::strerror(errno));
    if (n == 0)
      return io_error(path, what,
                      "ended after " + std::to_string(done) + " of its " + std::to_string(size) +
                          " bytes: it changed while being read");
    done += size_t(n);
  }
  out->swap(bytes);
  return Status::Ok();
}

}  // namespace

Status read_file(const std::string& path, const char* what, std::string* out, size_t max_bytes) {
  // O_NONBLOCK: opening a FIFO would otherwise wait for a writer; fstat then refuses it.
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    Code code = (err == ENOENT || err == ENOTDIR) ? Code::kNotFound : Code::kIoError;
    return Status::Error(code,
                         std::string(what) + " not found or unreadable: " + path + " (" + std::strerror(err) + ")");
  }
  struct stat info;
  Status st;
  if (::fstat(fd, &info) != 0)
    st = io_error(path, what, std::string("cannot be examined: ") + std::strerror(errno));
  else if (!S_ISREG(info.st_mode))
    st = io_error(path, what, std::string("is ") + file_kind(info.st_mode) + ", not a regular file");
  else if (uint64_t(info.st_size) > max_bytes)
    st = io_error(path, what,
                  "is " + std::to_string(info.st_size) + " bytes, more than the " + std::to_string(max_bytes) + " a " +
                      what + " may hold");
  else
    st = read_exactly(fd, size_t(info.st_size), path, what, out);
  ::close(fd);
  return st;
}

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty() || dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

}  // namespace flash_reasoning

namespace flash_reasoning {

Status list_folders_with(const std::string& dir, const std::string& marker, std::vector<std::string>* out) {
  DIR* d = opendir(dir.c_str());
  if (!d)
    return Status::Error(Code::kNotFound, "artifact folder " + dir + " cannot be opened: " + std::strerror(errno));
  out->clear();
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    struct stat info;
    if (name[0] != '.' && stat(join_path(join_path(dir, name), marker).c_str(), &info) == 0) out->push_back(name);
  }
  closedir(d);
  std::sort(out->begin(), out->end());
  return Status::Ok();
}

}  // namespace flash_reasoning
